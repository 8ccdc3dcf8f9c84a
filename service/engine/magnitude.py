"""No finite input answered wrong: the largest input values for which no step of attention can
overflow the compute's floating-point format, derived from the weights once, at load.

A backend that meets an overflow may say so (ORT returns NaN) or may not: PyTorch's CPU
attention turns a row of NaN scores into zeros, and the answer is o_proj's bias, finite and
wrong. So the bound is checked before any backend runs, for every backend and every decode step.

For an input row x (|x| its Euclidean norm r), with spectral norms a and bias norms c:
  q, k, v  |q| <= a_q r + c_q  (and alike): every partial sum of the projections too;
  scores   |q_h . k_h| <= |q| |k|  (Cauchy-Schwarz, partial sums included): the product before
           its 1 / sqrt(hs) scale, as `q @ k^T / sqrt(hs)` computes it, bounds the scaled one too;
  heads    a convex combination of v rows, so the merged heads <= sqrt(nh) max |v|;
  y        <= a_o sqrt(nh) max |v| + c_o.
Each must stay below the format's largest value over MARGIN (slack for rounding). The
check reads max |x| (r <= sqrt(C) max |x|): conservative, and one pass over the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from model import MHAConfig
from model.checkpoint import Weights
from service.arrays import sum_of_squares
from service.errors import InvalidInput

LARGEST = {"fp32": float(np.finfo(np.float32).max), "fp16": 65504.0, "bf16": float(torch.finfo(torch.bfloat16).max)}
FORMAT_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
MARGIN = 4.0  # a factor of slack for the rounding of each sum (the bounds above are worst cases already)


@dataclass(frozen=True)
class MagnitudeBound:
    max_abs: float  # the largest |x| element accepted
    precision: str

    def check(self, x: np.ndarray) -> None:
        """Refuse (B, T, C) whose values could overflow the compute; NaN and inf are left to the
        checks that name them. A small input is first passed in one cheaper pass: max |x| is at
        most the Euclidean norm, and a float32 sum of squares is within a factor of 2 of its
        value for the inputs it takes (ONE_PASS_MAX elements)."""
        if sum_of_squares(x) <= self.max_abs * self.max_abs / 2:  # False for NaN: the exact check says
            return
        largest = max(float(x.max(initial=0.0)), -float(x.min(initial=0.0)))
        if largest > self.max_abs and math.isfinite(largest):
            raise InvalidInput(
                f"the input holds values up to {largest:.3g}, beyond the |x| <= {self.max_abs:.3g} this model "
                f"accepts: they could overflow {FORMAT_NAMES[self.precision]} inside attention and answer wrong; "
                "scale the input down"
            )


def magnitude_bound(config: MHAConfig, weights: Weights, precision: str = "fp32") -> MagnitudeBound:
    """The bound for `weights` computed in `precision` (fp32, fp16 or bf16)."""
    norms = {name: _norms(weights, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    (a_q, c_q), (a_k, c_k), (a_v, c_v), (a_o, c_o) = norms.values()
    ceiling = LARGEST[precision] / MARGIN
    nh = config.n_head
    # (a_q r + c_q)(a_k r + c_k) <= ceiling: the larger root of a r^2 + b r + c = 0
    a, b, c = a_q * a_k, a_q * c_k + a_k * c_q, c_q * c_k - ceiling
    r_scores = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if a > 0 else math.inf
    v_max = (ceiling - c_o) / (a_o * math.sqrt(nh)) if a_o > 0 else ceiling  # the largest |v| row allowed
    r_values = (min(v_max, ceiling) - c_v) / a_v if a_v > 0 else math.inf
    r = max(0.0, min(r_scores, r_values, (ceiling - c_q) / max(a_q, 1e-30), (ceiling - c_k) / max(a_k, 1e-30)))
    return MagnitudeBound(max_abs=r / math.sqrt(config.d_model), precision=precision)


def _norms(weights: Weights, name: str) -> tuple[float, float]:
    """(spectral norm of the weight, Euclidean norm of the bias), in float64."""
    weight = weights[f"{name}.weight"].to(torch.float64)
    bias = weights.get(f"{name}.bias")
    spectral = float(torch.linalg.matrix_norm(weight, ord=2))
    return spectral, float(torch.linalg.vector_norm(bias.to(torch.float64))) if bias is not None else 0.0
