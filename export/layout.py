"""The model directory `mha export` writes and `mha serve` reads: file and tensor names.

Light on purpose (no torch, no onnx): the service and the client import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WEIGHTS_FILE = "weights.safetensors"
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
STEP_FILE = "step.onnx"  # incremental decoding: new tokens with the past keys and values
INPUT_NAME = "x"  # (batch, seq, C) float32
OUTPUT_NAME = "y"  # (batch, seq, C) float32
PAST_NAMES = ("past_key", "past_value")  # (batch, n_head, past, head_size) float32, step.onnx inputs
PRESENT_NAMES = ("present_key", "present_value")  # (batch, n_head, past + new, head_size), its outputs
PRECISIONS = ("fp32", "fp16", "bf16")


def precision_file(precision: str) -> str:
    """model.onnx computes in fp32; model.fp16.onnx and model.bf16.onnx in half (fp32 in and out)."""
    return MODEL_FILE if precision == "fp32" else f"model.{precision}.onnx"


@dataclass(frozen=True)
class ModelFiles:
    """The three files of one model directory."""

    directory: Path

    @property
    def weights(self) -> Path:
        return self.directory / WEIGHTS_FILE

    @property
    def onnx(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def step(self) -> Path:
        return self.directory / STEP_FILE

    @property
    def manifest(self) -> Path:
        return self.directory / MANIFEST_FILE
