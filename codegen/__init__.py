"""portlayer.codegen"""
