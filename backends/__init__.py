"""portlayer.backends: the adapter contract and the registry of device adapters."""

from portlayer.backends.base import BackendAdapter, BackendError, MemoryInfo
from portlayer.backends.registry import available_backends, get_backend, register_backend

__all__ = ["BackendAdapter", "BackendError", "MemoryInfo", "available_backends", "get_backend", "register_backend"]
