"""The module against both float64 references, and the worked examples of the reference texts."""

from __future__ import annotations

import math

import pytest
import torch

from model import MHAConfig, MultiHeadAttention
from model.checkpoint import init_weights
from model.reference import (
    attention_einsum,
    attention_view,
    causal_mask,
    linear_rounding_error,
    relative_error,
    score_rounding_error,
)

CONFIGS = [
    MHAConfig(),
    MHAConfig(d_model=96, n_head=6, max_seq_len=300),
    MHAConfig(d_model=24, n_head=3, max_seq_len=17, causal=False),
    MHAConfig(d_model=10, n_head=5, max_seq_len=7, bias=False),
    MHAConfig(d_model=8, n_head=1, max_seq_len=9),
]


def _seq_lens(config: MHAConfig) -> list[int]:
    return sorted({1, 2, min(13, config.max_seq_len), config.max_seq_len})


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"C{c.d_model}h{c.n_head}L{c.max_seq_len}c{int(c.causal)}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fast", [True, False], ids=["sdpa", "plain"])
def test_module_matches_both_references(config: MHAConfig, dtype: torch.dtype, fast: bool) -> None:
    weights = init_weights(config, seed=7)
    module = MultiHeadAttention.from_weights(config, weights, fast=fast).to(dtype)
    gen = torch.Generator().manual_seed(11)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for T in _seq_lens(config):
        x = torch.randn(3, T, config.d_model, generator=gen, dtype=torch.float64)
        with torch.inference_mode():
            y = module(x.to(dtype))
        ref_view = attention_view(x, weights, config)
        ref_einsum = attention_einsum(x, weights, config)
        assert y.dtype == dtype and y.shape == x.shape
        assert relative_error(ref_view, ref_einsum) < 1e-13
        assert relative_error(y, ref_view) < tolerance, (T, relative_error(y, ref_view))
        assert relative_error(y, ref_einsum) < tolerance


def test_references_differ_between_causal_and_not() -> None:
    causal = MHAConfig(d_model=16, n_head=2)
    bidirectional = MHAConfig(d_model=16, n_head=2, causal=False)
    weights = init_weights(causal, seed=1)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y_c = attention_view(x, weights, causal)
    y_b = attention_view(x, weights, bidirectional)
    assert relative_error(y_c, y_b) > 1e-3
    # the last position sees everything in both, so it agrees
    assert torch.allclose(y_c[:, -1], y_b[:, -1], atol=1e-12)


def test_causal_output_ignores_the_future() -> None:
    config = MHAConfig(d_model=16, n_head=4)
    weights = init_weights(config, seed=2)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 5:] = torch.randn(1, 4, 16, dtype=torch.float64)
    for ref in (attention_view, attention_einsum):
        assert torch.allclose(ref(x, weights, config)[:, :5], ref(changed, weights, config)[:, :5], atol=1e-12)


def _identity_weights(C: int, o_bias: float = 0.0) -> dict[str, torch.Tensor]:
    eye = torch.eye(C, dtype=torch.float64)
    weights = {f"{n}.weight": eye for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    weights |= {f"{n}.bias": torch.zeros(C, dtype=torch.float64) for n in ("q_proj", "k_proj", "v_proj")}
    weights["o_proj.bias"] = torch.full((C,), o_bias, dtype=torch.float64)
    return weights


def _all_implementations(
    config: MHAConfig, weights: dict[str, torch.Tensor], x: torch.Tensor
) -> dict[str, torch.Tensor]:
    out = {"view": attention_view(x, weights, config), "einsum": attention_einsum(x, weights, config)}
    for fast in (True, False):
        module = MultiHeadAttention.from_weights(config, weights, fast=fast).double()
        with torch.inference_mode():
            out["sdpa" if fast else "plain"] = module(x)
    return out


def test_worked_example_three_tokens_by_hand() -> None:
    """One head, C = 2, identity projections: scores x x^T / sqrt(2), worked out on paper.

    t=0 sees only itself: y0 = x0. t=1 weighs x0, x1 by softmax(0, 1/sqrt 2). t=2 weighs x0, x1, x2
    by softmax(1, 1, 2) / sqrt 2 (scaled before the softmax).
    """
    config = MHAConfig(d_model=2, n_head=1, max_seq_len=3)
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)
    a = math.exp(1 / math.sqrt(2))  # e^(score 1) for a dot product of 1
    w1 = (1 / (1 + a), a / (1 + a))
    w2 = (a / (2 * a + a * a), a / (2 * a + a * a), a * a / (2 * a + a * a))
    expected = torch.tensor(
        [[[1.0, 0.0], [w1[0], w1[1]], [w2[0] + w2[2], w2[1] + w2[2]]]], dtype=torch.float64
    )  # (B, T, C)
    for name, y in _all_implementations(config, _identity_weights(2), x).items():
        assert torch.allclose(y, expected, atol=1e-12), name


def test_worked_example_one_token_is_its_value_projected() -> None:
    """With T = 1 the softmax is 1 whatever the scores: y = o_proj(v_proj(x)) = x + 1 here."""
    config = MHAConfig(d_model=4, n_head=2, max_seq_len=4)
    weights = _identity_weights(4, o_bias=1.0)
    weights["q_proj.weight"] = torch.randn(4, 4, dtype=torch.float64)  # irrelevant at T = 1
    x = torch.randn(3, 1, 4, dtype=torch.float64)
    for name, y in _all_implementations(config, weights, x).items():
        assert torch.allclose(y, x + 1, atol=1e-12), name


def test_causal_mask_t4() -> None:
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(4), expected)


def test_scale_is_one_over_sqrt_head_size() -> None:
    """With identity projections and no bias, one head: y = softmax(x x^T / sqrt(C)) x."""
    config = MHAConfig(d_model=4, n_head=1, causal=False, bias=False)
    eye = torch.eye(4, dtype=torch.float64)
    weights = {f"{n}.weight": eye for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    expected = torch.softmax(x[0] @ x[0].T / math.sqrt(4), dim=-1) @ x[0]
    assert torch.allclose(attention_view(x, weights, config)[0], expected, atol=1e-12)
    assert torch.allclose(attention_einsum(x, weights, config)[0], expected, atol=1e-12)


def _heads(x: torch.Tensor, weights: dict, config: MHAConfig, name: str) -> torch.Tensor:
    B, T, _ = x.shape
    projected = x @ weights[f"{name}.weight"].T + weights[f"{name}.bias"]  # (B, T, C)
    return projected.view(B, T, config.n_head, config.head_size).transpose(1, 2)  # (B, nh, T, hs)


@pytest.mark.parametrize("past", [0, 1, 7, 11])
def test_a_step_over_its_past_answers_the_last_rows_of_its_whole_prefix(past: int) -> None:
    """A decode step's new tokens attending to the past keys and values as given (the audit's
    reference for a step) answer what the whole prefix answers for them, in both formulations."""
    config = MHAConfig(d_model=16, n_head=2, max_seq_len=32)
    weights = init_weights(config, seed=4)
    x = torch.randn(3, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w64 = {k: v.to(torch.float64) for k, v in weights.items()}
    held = (_heads(x[:, :past], w64, config, "k_proj"), _heads(x[:, :past], w64, config, "v_proj"))  # (B, nh, P, hs)
    step = attention_view(x[:, past:], weights, config, held)  # (B, T - P, C)
    assert relative_error(step, attention_view(x, weights, config)[:, past:]) < 1e-14
    assert relative_error(step, attention_einsum(x, weights, config)[:, past:]) < 1e-13
    wrong = (held[0], held[1] + 0.1)  # a past of other values answers otherwise
    assert past == 0 or relative_error(attention_view(x[:, past:], weights, config, wrong), step) > 1e-3


@pytest.mark.parametrize("past", [0, 5])
@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_score_rounding_error_bounds_what_scores_moved_within_their_reach_do(scale: float, past: int) -> None:
    """score_rounding_error(x) is a first-order bound: scores each moved by at most d times the
    size their dot product reaches (|q| |k| / sqrt(hs)) move the answer by at most d times it; of
    a decode step's tokens over their past too."""
    config = MHAConfig(d_model=16, n_head=2, max_seq_len=32)
    weights = {k: v.to(torch.float64) for k, v in init_weights(config, seed=2).items()}
    weights["o_proj.weight"] = weights["o_proj.weight"] * 10  # a spectral norm above 1, as trained ones have
    generator, d, new = torch.Generator().manual_seed(0), 1e-9, 12 - past
    for _ in range(10):
        x = torch.randn(1, 12, 16, dtype=torch.float64, generator=generator) * scale
        q, k, v = (_heads(x, weights, config, name) for name in ("q_proj", "k_proj", "v_proj"))
        q = q[:, :, past:]  # (1, nh, T - P, hs): the step's queries; every key and value attended to
        reach = q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :] / math.sqrt(8)  # (1, nh, T - P, T)
        signs = torch.randint(0, 2, reach.shape, generator=generator).to(torch.float64) * 2 - 1
        att = (q @ k.transpose(-2, -1)) / math.sqrt(8) + d * reach * signs  # (1, nh, T - P, T), each moved
        att = torch.softmax(att.masked_fill(~causal_mask(new, past), -math.inf), dim=-1)
        heads = (att @ v).transpose(1, 2).reshape(1, new, 16)  # (1, T - P, C)
        moved = heads @ weights["o_proj.weight"].T + weights["o_proj.bias"]
        held = (k[:, :, :past], v[:, :, :past]) if past else None
        bound = score_rounding_error(x[:, past:], weights, config, held)
        exact = attention_view(x, weights, config)[:, past:]
        assert relative_error(moved, exact) <= d * bound * 1.001 + 1e-15


def test_linear_rounding_error_covers_an_input_whose_terms_cancel() -> None:
    """Tokens made to answer zero (v_proj then o_proj cancelling their biases) are answered in fp32
    as exactly as it can, yet far from zero relative to it: the scores' estimate does not cover
    that error, the linear layers' terms do."""
    config = MHAConfig(d_model=16, n_head=2, max_seq_len=32)
    weights = init_weights(config, seed=2)
    w = {k: v.to(torch.float64) for k, v in weights.items()}
    zero = torch.linalg.solve(
        w["o_proj.weight"] @ w["v_proj.weight"], -(w["v_proj.bias"] @ w["o_proj.weight"].T + w["o_proj.bias"])
    )  # (C,): the token whose values o_proj maps to zero
    x = zero.float().repeat(1, 9, 1)  # (1, T, C), every token that one
    u = 2.0**-24
    for fast in (True, False):
        with torch.inference_mode():
            y = MultiHeadAttention.from_weights(config, weights, fast=fast)(x)
        error = relative_error(y, attention_view(x, weights, config))
        assert error > 1e-3 and error > 8 * u * score_rounding_error(x, weights, config)
        assert error <= u * linear_rounding_error(x, weights, config)
    ordinary = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert 1 <= linear_rounding_error(ordinary, weights, config) < 1e3  # the terms' size is at least the answer's


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 100, "n_head": 8}, "divisible"),
        ({"d_model": 0}, "d_model must be positive"),
        ({"n_head": -1}, "n_head must be positive"),
        ({"max_seq_len": 0}, "max_seq_len must be positive"),
        ({"d_model": 12.0}, "d_model must be an int"),
        ({"causal": 1}, "causal must be a bool"),
    ],
)
def test_config_rejects_invalid(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MHAConfig(**kwargs)


def test_config_json_round_trip_and_unknown_keys() -> None:
    config = MHAConfig(d_model=96, n_head=6, max_seq_len=300, causal=False)
    assert MHAConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="unknown config keys"):
        MHAConfig.from_dict({"d_model": 8, "heads": 2})
