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
# incremental decoding, in two graphs so that a sequence's cache is read where it lies:
STEP_PROJECT_FILE = "step_project.onnx"  # x (rows, new, C) -> PROJECTED_NAMES, each (rows, nh, new, hs)
STEP_ATTEND_FILE = "step_attend.onnx"  # the query, CACHE_NAMES and PAST_LENGTH_NAME -> y (rows, new, C)
INPUT_NAME = "x"  # (batch, seq, C) float32
OUTPUT_NAME = "y"  # (batch, seq, C) float32
PROJECTED_NAMES = ("query", "key", "value")  # the new tokens' (rows, n_head, new, head_size) float32
CACHE_NAMES = ("key_cache", "value_cache")  # (rows, n_head, capacity, head_size): the new keys already in
PAST_LENGTH_NAME = "past_length"  # int64 scalar: tokens before the new ones; past + new <= capacity
PRECISIONS = ("fp32", "fp16", "bf16")


def precision_file(precision: str) -> str:
    """model.onnx computes in fp32; model.fp16.onnx and model.bf16.onnx in half (fp32 in and out)."""
    return MODEL_FILE if precision == "fp32" else f"model.{precision}.onnx"


@dataclass(frozen=True)
class ModelFiles:
    """The files of one model directory."""

    directory: Path

    @property
    def weights(self) -> Path:
        return self.directory / WEIGHTS_FILE

    @property
    def onnx(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def steps(self) -> tuple[Path, Path]:
        """The step graphs: projections, then attention over the cache."""
        return self.directory / STEP_PROJECT_FILE, self.directory / STEP_ATTEND_FILE

    @property
    def manifest(self) -> Path:
        return self.directory / MANIFEST_FILE


UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}  # half the gap between 1 and the next value


def precision_tolerance(precision: str, config: MHAConfig) -> float:
    """The relative error a graph in `precision` may show against the float64 reference: the
    format's unit roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8) times one rounding per op on the
    path and the depth of the longest sum (log2 of C or T, as pairwise sums grow), for fp32 with
    the suite's fixed 1e-5 floor."""
    if precision == "fp32":
        return 1e-5
    return UNIT_ROUNDOFF[precision] * (2 + math.log2(max(config.d_model, config.max_seq_len)))
