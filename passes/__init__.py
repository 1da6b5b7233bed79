"""portlayer.passes"""
