"""No finite input is answered OK and wrong, on any backend or on the decode path: every answer is
within tolerance of the float64 reference, or INVALID_ARGUMENT. (PyTorch's CPU attention turned
rows of overflowing scores into zeros and answered o_proj's bias, OK, from values of about 1e20.)

The bound is pinned independently of the code that computes it: the worst-case inputs below (sign
patterns along the top singular directions of each head's W_q^T W_k, and of W_o W_v) are scaled
until the float64 reference's intermediates leave the compute format, and the bound must keep a
factor 2 from there; for identity projections it has a closed form."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export.layout import UNIT_ROUNDOFF
from model import MHAConfig
from model.checkpoint import Weights, init_weights, load_checkpoint
from model.reference import attention_view, relative_error, score_rounding_error
from service.client.client import InferenceError, MHAClient
from service.engine.audit import ROUNDING_FACTOR
from service.numerics import magnitude_bound
from tests.support import ComputeGate, ServerThread, make_settings

TOLERANCE = 1e-5  # float32 against float64, for inputs whose scores rounding does not move further
LARGEST = {"fp32": float(np.finfo(np.float32).max), "fp16": 65504.0, "bf16": float(torch.finfo(torch.bfloat16).max)}


def _largest_intermediate(x: torch.Tensor, weights: Weights, config: MHAConfig) -> float:
    """max |value| of every intermediate of the reference formulation, in float64: the projections,
    the scores before and after their scale, the merged heads and the output."""
    B, T, C = x.shape
    nh, hs = config.n_head, C // config.n_head

    def linear(name: str, t: torch.Tensor) -> torch.Tensor:
        bias = weights.get(f"{name}.bias")
        return t @ weights[f"{name}.weight"].double().T + (bias.double() if bias is not None else 0.0)

    x = x.double()
    q, k, v = (linear(n, x).view(B, T, nh, hs).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
    # q, k, v: (B, nh, T, hs)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    raw = (q @ k.transpose(-2, -1)).masked_fill(~causal, 0.0)  # (B, nh, T, T), before the 1 / sqrt(hs) scale
    att = torch.softmax((raw / hs**0.5).masked_fill(~causal, -torch.inf), dim=-1)
    heads = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    return max(float(t.abs().max()) for t in (q, k, v, raw, heads, linear("o_proj", heads)))


def _worst_directions(weights: Weights, config: MHAConfig) -> dict[str, torch.Tensor]:
    """(T, C) sign patterns, the largest Euclidean norm per largest |x|, along the directions that
    grow each intermediate most: for each head, a query token along the top left singular vector of
    W_q^T W_k after a key token along its right one, and a token along the top eigenvector of its
    symmetric part (a token attending to itself); one token along the top right singular vector of
    W_o W_v."""
    C, hs = config.d_model, config.head_size
    patterns: dict[str, torch.Tensor] = {}
    for h in range(config.n_head):
        rows = slice(h * hs, (h + 1) * hs)
        m = weights["q_proj.weight"].double()[rows].T @ weights["k_proj.weight"].double()[rows]  # (C, C)
        u, _, vh = torch.linalg.svd(m)
        patterns[f"head {h}: query after key"] = torch.stack([torch.sign(vh[0]), torch.sign(u[:, 0])])  # (2, C)
        eigenvalues, eigenvectors = torch.linalg.eigh((m + m.T) / 2)
        patterns[f"head {h}: a token on itself"] = torch.sign(eigenvectors[:, int(eigenvalues.abs().argmax())])[None]
    _, _, vh = torch.linalg.svd(weights["o_proj.weight"].double() @ weights["v_proj.weight"].double())
    patterns["values and output"] = torch.sign(vh[0])[None]  # (1, C)
    assert all(p.shape[-1] == C and bool((p.abs() == 1).all()) for p in patterns.values())
    return patterns


def _overflow_scale(pattern: torch.Tensor, weights: Weights, config: MHAConfig, largest: float) -> float:
    """The smallest scale s (to within 1e-9) at which s * pattern drives an intermediate past `largest`."""
    low, high = 1.0, 1e39
    while high / low > 1 + 1e-9:
        middle = (low * high) ** 0.5
        if _largest_intermediate(middle * pattern[None], weights, config) > largest:
            high = middle
        else:
            low = middle
    return high


WORST_CASE_CONFIGS = {  # (config, seed): the small test model, the default one, and a head of 256
    "C32-4-heads": (MHAConfig(d_model=32, n_head=4, max_seq_len=64), 3),
    "C128-8-heads": (MHAConfig(), 0),
    "C256-1-head": (MHAConfig(d_model=256, n_head=1, max_seq_len=64), 1),
}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", WORST_CASE_CONFIGS.values(), ids=WORST_CASE_CONFIGS.keys())
def test_the_bound_keeps_a_factor_2_from_the_worst_case_overflow(case: tuple[MHAConfig, int], precision: str) -> None:
    config, seed = case
    weights = init_weights(config, seed=seed)
    largest = LARGEST[precision]
    scales = {n: _overflow_scale(p, weights, config, largest) for n, p in _worst_directions(weights, config).items()}
    first = min(scales, key=scales.__getitem__)
    bound = magnitude_bound(config, weights, precision).max_abs
    assert bound <= scales[first] / 2, (
        f"the bound {bound:.4g} is within a factor 2 of {scales[first]:.4g}, where {first} overflows {precision}"
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(32, 4), (128, 8), (256, 1)])
def test_the_bound_for_identity_projections_has_a_closed_form(shape: tuple[int, int], precision: str) -> None:
    """W = I, no bias: |q| = |k| = |v| = |x| = r, so q . k <= r^2 and the merged heads and y <= sqrt(nh) r. With
    the format's largest value L over a slack of 4 for rounding: r^2 <= L / 4 and sqrt(nh) r <= L / 4, and
    max |x| = r / sqrt(C)."""
    C, nh = shape
    config = MHAConfig(d_model=C, n_head=nh, max_seq_len=64, bias=False)
    weights = {f"{n}.weight": torch.eye(C) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    ceiling = LARGEST[precision] / 4
    r = min(ceiling**0.5, ceiling / nh**0.5)
    expected = r / C**0.5
    assert magnitude_bound(config, weights, precision).max_abs == pytest.approx(expected, rel=1e-9)


@pytest.fixture(scope="module", params=["torch", "ort-cpu"])
def server(request: pytest.FixtureRequest, small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend=request.param)) as s:
        yield s


def _exact_or_refused(call, x: np.ndarray, reference: torch.Tensor, weights: Weights, config: MHAConfig) -> str:  # type: ignore[no-untyped-def]
    """Refused as the client's mistake, or answered within float32's own error on `x`: 1e-5, or
    what rounding its attention scores costs (the audit's allowance)."""
    try:
        y = call(x)
    except InferenceError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT, exc
        return "refused"
    error = relative_error(torch.from_numpy(np.ascontiguousarray(y)), reference)
    allowed = max(
        TOLERANCE, ROUNDING_FACTOR * UNIT_ROUNDOFF["fp32"] * score_rounding_error(torch.from_numpy(x), weights, config)
    )
    assert error <= allowed, (
        f"answered OK and wrong: relative error {error:.3g} > {allowed:.3g} at max |x| {np.abs(x).max():.3g}"
    )
    return "answered"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(exponent=st.integers(0, 38), T=st.integers(1, 63), B=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_every_finite_input_is_answered_exactly_or_refused(
    server: ServerThread, small_model_dir: Path, exponent: int, T: int, B: int, seed: int
) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    normal = np.clip(np.random.default_rng(seed).standard_normal((B, T, config.d_model)), -3, 3)
    x = (normal * 10.0**exponent).astype(np.float32)  # up to 3e38: every value a finite float32
    assert np.isfinite(x).all()
    reference = attention_view(torch.from_numpy(x), weights, config)
    with MHAClient(server.url) as client:
        _exact_or_refused(client.infer, x, reference, weights, config)
        sequence = client.sequence(f"magnitude-{seed}-{exponent}-{T}-{B}")
        _exact_or_refused(sequence.send, x, reference, weights, config)  # the decode path, on its own cache
        if sequence.length:
            client.step(sequence.id, x[:, :1], sequence.length, end=True)


def test_the_values_that_broke_pytorch_are_refused_and_the_largest_accepted_are_exact(
    server: ServerThread, small_model_dir: Path
) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    bound = magnitude_bound(config, weights)
    rng = np.random.default_rng(0)
    with MHAClient(server.url) as client:
        for T in (1, 2, 4):
            x = (rng.standard_normal((1, T, config.d_model)) * 1e20).astype(np.float32)
            with pytest.raises(InferenceError) as info:
                client.infer(x)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "scale the input down" in str(info.value)
            x = rng.standard_normal((1, T, config.d_model)).astype(np.float32)
            x *= np.float32(0.99 * bound.max_abs / np.abs(x).max())  # just under the bound: computed, exactly
            reference = attention_view(torch.from_numpy(x), weights, config)
            assert _exact_or_refused(client.infer, x, reference, weights, config) == "answered"


def test_an_overflowing_input_cannot_make_the_server_check_itself(small_model_dir: Path) -> None:
    """With one backend, an output that overflowed used to be judged by re-running the whole
    self-check, batch after batch, as often as a client liked; such inputs are now refused first."""
    gate = ComputeGate(held=())
    with ServerThread(make_settings(small_model_dir, backend="ort-cpu"), compute_hook=gate) as server:
        x = (np.random.default_rng(0).standard_normal((1, 4, 32)) * 1e20).astype(np.float32)
        with MHAClient(server.url) as client:
            for _ in range(5):
                with pytest.raises(InferenceError) as info:
                    client.infer(x)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert gate.computed == []  # refused before any compute: no output to judge, no probe to run


def test_worst_case_inputs_are_refused_near_overflow_and_exact_at_the_bound(
    server: ServerThread, small_model_dir: Path
) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    bound = magnitude_bound(config, weights).max_abs
    patterns = _worst_directions(weights, config)
    with MHAClient(server.url) as client:
        for name, pattern in patterns.items():
            overflow = _overflow_scale(pattern, weights, config, LARGEST["fp32"])
            for scale in (overflow / 2, overflow, 4 * overflow):
                x = (scale * pattern[None]).numpy().astype(np.float32)  # (1, T, C)
                with pytest.raises(InferenceError) as info:
                    client.infer(x)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, (name, scale)
                assert "scale the input down" in str(info.value), (name, scale, str(info.value))
            x = (0.99 * bound * pattern[None]).numpy().astype(np.float32)  # just under the bound
            reference = attention_view(torch.from_numpy(x), weights, config)
            assert _exact_or_refused(client.infer, x, reference, weights, config) == "answered", name
            step = partial(client.step, f"worst-{name}", offset=0, start=True, end=True)
            assert _exact_or_refused(lambda x, step=step: step(x).y, x, reference, weights, config) == "answered", name
