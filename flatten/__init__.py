"""portlayer.flatten"""
