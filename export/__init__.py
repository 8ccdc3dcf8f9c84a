"""ONNX export with dynamic batch and sequence length, parity verification, manifest."""

from export.pipeline import export_model_dir
from export.verify import ParityReport, verify_model_dir

__all__ = ["ParityReport", "export_model_dir", "verify_model_dir"]
