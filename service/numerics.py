"""The numerics policy, in one place: no request is answered OK with a wrong number.

Every path (stateless batches, decode steps, the fallback chain, the audit) asks this module:

- **Inputs within the bound.** `MagnitudeBound.check` refuses, before any backend runs, input
  values that could overflow the compute's format inside attention (derived below from the
  weights once, at load).
- **Finite in, finite out.** `all_finite` is the one finiteness test; `refuse_non_finite` turns
  a non-finite answer into INVALID_ARGUMENT worded for the client (`not_finite`), and a decode
  step whose output is not finite commits nothing.

Why a bound and not only the finiteness check: a backend that meets an overflow may say so (ORT
returns NaN) or may not: PyTorch's CPU attention turns a row of NaN scores into zeros, and the
answer is o_proj's bias, finite and wrong.

For an input row x (|x| its Euclidean norm r), with spectral norms a and bias norms c:
  q, k, v  |q| <= a_q r + c_q  (and alike): every partial sum of the projections too;
  scores   |q_h . k_h| <= |q| |k|  (Cauchy-Schwarz, partial sums included): the product before
           its 1 / sqrt(hs) scale, as `q @ k^T / sqrt(hs)` computes it, bounds the scaled one too;
  heads    a convex combination of v rows, so the merged heads <= sqrt(nh) max |v|;
  y        <= a_o sqrt(nh) max |v| + c_o.
Each must stay below the format's largest value over MARGIN (slack for rounding). The check reads
max |x| (r <= sqrt(C) max |x|): conservative, and one pass over the input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import InvalidInput

if TYPE_CHECKING:
    from model import MHAConfig

ONE_PASS_MAX = 1 << 16  # elements up to which a BLAS dot is the cheapest pass (a third of a sum's time)
LARGEST = {"fp32": float(np.finfo(np.float32).max), "fp16": 65504.0, "bf16": 3.3895313892515355e38}
FORMAT_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
MARGIN = 4.0  # a factor of slack for the rounding of each sum (the bounds above are worst cases already)


def sum_of_squares(x: np.ndarray) -> float:
    """sum(x**2) of a small contiguous float array in one pass (NaN when `x` holds NaN, inf when it
    holds inf or its squares overflow); NaN too for an array this shortcut does not take (large or
    strided), so that a caller falls back to its exact check. `np.vdot` (a BLAS dot, like `np.dot`)
    neither checks the floating-point flags afterwards nor needs a flat view: an overflow is an
    answer here, not a fault, and no `np.errstate` is needed around it (half the call's time)."""
    if x.size > ONE_PASS_MAX or not x.flags.c_contiguous:
        return math.nan
    return float(np.vdot(x, x))


def all_finite(x: np.ndarray) -> bool:
    """NaN and inf propagate into a sum, so a finite sum proves every value finite with one
    reduction and no boolean array; only a non-finite (or overflowing) sum takes the exact check."""
    if math.isfinite(sum_of_squares(x)):
        return True
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is expected, not a fault
        total = np.add.reduce(x, axis=None)
    return bool(np.isfinite(total)) or bool(np.isfinite(x).all())


FLOAT32_RANGE = " (a number beyond float32's range, |x| > 3.4e38, is read as inf)"


def not_finite(x: np.ndarray) -> str:
    """Why a request's output is not finite. Its input's values were checked only then: a NaN or
    inf in the input always reaches the output of its own rows, so a finite output proves the input
    finite without a pass over it."""
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        return f"the input holds {bad} NaN or inf values; expected finite floats{FLOAT32_RANGE}"
    return (
        f"the output is not finite: the input's values (largest |x| = {float(np.abs(x).max()):.3g}) "
        "overflow float32 inside attention; scale them down (see docs/api.md for the safe range)"
    )


def refuse_non_finite(x: np.ndarray, y: np.ndarray, known_finite: bool = False, then: str = "") -> None:
    """The answer `y` to input `x` goes out only if finite; otherwise INVALID_ARGUMENT saying why
    (`then`: what became of the request, e.g. that a step was not committed). `known_finite`: the
    batch `y` came from was already found finite."""
    if not known_finite and not all_finite(y):
        raise InvalidInput(f"{not_finite(x)}; {then}" if then else not_finite(x))


def refuse_non_finite_input(x: np.ndarray) -> None:
    """INVALID_ARGUMENT for NaN or inf in `x`, where no output will show them (a sequence's start,
    which would drop the sequence's state before its output is known)."""
    if not all_finite(x):
        raise InvalidInput(not_finite(x))


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


def magnitude_bound(config: MHAConfig, weights: Mapping[str, Any], precision: str = "fp32") -> MagnitudeBound:
    """The bound for `weights` (torch tensors by parameter name) computed in `precision` (fp32,
    fp16 or bf16)."""
    norms = {name: _norms(weights, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    (a_q, c_q), (a_k, c_k), (a_v, c_v), (a_o, c_o) = norms.values()
    ceiling = LARGEST[precision] / MARGIN
    # (a_q r + c_q)(a_k r + c_k) <= ceiling: the larger root of a r^2 + b r + c = 0
    a, b, c = a_q * a_k, a_q * c_k + a_k * c_q, c_q * c_k - ceiling
    r_scores = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if a > 0 else math.inf
    v_max = (ceiling - c_o) / (a_o * math.sqrt(config.n_head)) if a_o > 0 else ceiling  # the largest |v| row allowed
    r_values = (min(v_max, ceiling) - c_v) / a_v if a_v > 0 else math.inf
    r = max(0.0, min(r_scores, r_values, (ceiling - c_q) / max(a_q, 1e-30), (ceiling - c_k) / max(a_k, 1e-30)))
    return MagnitudeBound(max_abs=r / math.sqrt(config.d_model), precision=precision)


def _norms(weights: Mapping[str, Any], name: str) -> tuple[float, float]:
    """(spectral norm of the weight, Euclidean norm of the bias), in float64."""
    weight = weights[f"{name}.weight"].double().numpy()  # (C, C)
    bias = weights.get(f"{name}.bias")
    spectral = float(np.linalg.norm(weight, ord=2))
    return spectral, float(np.linalg.norm(bias.double().numpy())) if bias is not None else 0.0
