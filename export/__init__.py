"""ONNX export with dynamic batch and sequence length, parity verification, manifest.

Import the submodules you need: `export.layout` is light, `export.pipeline` brings torch and onnx.
"""
