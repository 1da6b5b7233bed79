"""portlayer.runtime"""
