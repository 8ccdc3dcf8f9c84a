"""Backends that run the model: ONNX Runtime (CUDA, CPU) and PyTorch eager.

Import from the modules (`base`, `chain`, `selection`): this package loads neither library, so a
process that needs only the interfaces (the worker supervisor) does not pay for them.
"""
