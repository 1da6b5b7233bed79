"""portlayer.backends"""
