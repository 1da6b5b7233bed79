"""portlayer.capabilities"""
