"""Checks on float arrays shared by the codec, the core and the backends."""

from __future__ import annotations

import math

import numpy as np

ONE_PASS_MAX = 1 << 16  # elements up to which a BLAS dot is the cheapest pass (a third of a sum's time)


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


def not_finite(x: np.ndarray) -> str:
    """Why a request's output is not finite. Its input's values were checked only then: a NaN or
    inf in the input always reaches the output of its own rows, so a finite output proves the input
    finite without a pass over it."""
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        return f"the input holds {bad} NaN or inf values; expected finite floats"
    return (
        f"the output is not finite: the input's values (largest |x| = {float(np.abs(x).max()):.3g}) "
        "overflow float32 inside attention; scale them down (see docs/api.md for the safe range)"
    )
