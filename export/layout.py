"""The model directory `mha export` writes and `mha serve` reads: file and tensor names.

Light on purpose (no torch, no onnx): the service and the client import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model import MHAConfig

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


def precision_tolerance(precision: str, config: MHAConfig) -> float:
    """The relative error a graph in `precision` may show against the float64 reference: the
    format's unit roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8) times one rounding per op on the
    path and the depth of the longest sum (log2 of C or T, as pairwise sums grow), for fp32 with
    the suite's fixed 1e-5 floor."""
    if precision == "fp32":
        return 1e-5
    u = {"fp16": 2.0**-11, "bf16": 2.0**-8}[precision]
    return u * (2 + math.log2(max(config.d_model, config.max_seq_len)))
