"""One builder per kernel family: a kernel group -> rendered kernels + host statements."""
