"""The one-pass shortcuts of the float checks say what the exact checks say: a finite input is
never refused, and an input beyond the magnitude bound, or holding NaN or inf, never slips by."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import InvalidInput
from service.numerics import ONE_PASS_MAX, MagnitudeBound, all_finite, sum_of_squares

SPECIAL = st.sampled_from([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e20, 0.0]) | st.floats(-1e15, 1e15)  # spikes


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """(B, T, C) float32 inputs, small (the shortcut's) and large, contiguous and strided, with
    a few values set to NaN, inf, huge finite ones or spikes that dominate the rest."""
    rows, seq, width = draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.sampled_from([8, 32, 2048]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = (rng.standard_normal((rows, seq, width)) * 10.0 ** draw(st.integers(-3, 6))).astype(np.float32)
    for _ in range(draw(st.integers(0, 3))):
        x.flat[draw(st.integers(0, x.size - 1))] = draw(SPECIAL)
    return x[:, ::2] if draw(st.booleans()) else x  # a strided view, or the array itself


@settings(max_examples=200, deadline=None)
@given(x=arrays())
def test_all_finite_says_what_isfinite_says(x: np.ndarray) -> None:
    assert all_finite(x) == bool(np.isfinite(x).all())


def _exact_refusal(x: np.ndarray, max_abs: float) -> bool:
    with np.errstate(invalid="ignore"):
        largest = float(np.abs(x.astype(np.float64)).max())
    return bool(np.isfinite(largest)) and largest > max_abs


@settings(max_examples=200, deadline=None)
@given(x=arrays(), ratio=st.sampled_from([0.5, 0.71, 0.9, 0.99, 1.0, 1.01, 1.1, 1.42, 2.0]) | st.floats(0.3, 3.0))
def test_the_magnitude_check_refuses_exactly_the_inputs_beyond_the_bound(x: np.ndarray, ratio: float) -> None:
    """Bounds around the input's own largest value: the shortcut's factor of slack is tested
    where it matters, just below and just above."""
    with np.errstate(invalid="ignore"):
        finite = np.abs(x[np.isfinite(x)])
    max_abs = float(finite.max()) * ratio if finite.size and finite.max() > 0 else ratio
    bound = MagnitudeBound(max_abs=max_abs, precision="fp32")
    try:
        bound.check(x)
        refused = False
    except InvalidInput:
        refused = True
    assert refused == _exact_refusal(x, max_abs)


def test_the_shortcut_covers_the_small_requests_it_is_for() -> None:
    """(1, 64, 128) and a (1, 1, 128) decode step are what a lone client sends."""
    assert 64 * 128 <= ONE_PASS_MAX
    with pytest.raises(InvalidInput):
        MagnitudeBound(max_abs=10.0, precision="fp32").check(np.full((1, 64, 128), 10.5, np.float32))


def test_an_overflowing_sum_of_squares_is_an_answer_not_a_fault() -> None:
    """The one-pass sum overflows for large finite inputs; that must neither raise nor warn (a
    RuntimeWarning per request in the logs), whatever numpy's error state is: np.vdot does not
    check the floating-point flags (np.dot does: it would need np.errstate around it)."""
    huge = np.full((1, 64, 128), 3e38, np.float32)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        assert sum_of_squares(huge) == np.inf
        assert np.isnan(sum_of_squares(np.full((1, 2, 8), np.nan, np.float32)))
        assert all_finite(huge)
        MagnitudeBound(max_abs=1e39, precision="fp32").check(huge)  # within this bound: not refused
