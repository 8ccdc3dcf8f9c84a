"""Backends that run the model: ONNX Runtime (CUDA, CPU) and PyTorch eager."""

from service.backends.base import Backend, BackendLoadError
from service.backends.chain import BackendChain
from service.backends.selection import BackendSpec, Selection, select_backends

__all__ = ["Backend", "BackendChain", "BackendLoadError", "BackendSpec", "Selection", "select_backends"]
