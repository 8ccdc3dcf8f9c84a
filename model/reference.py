"""Two float64 references for the attention block, to check everything else against.

Both take the weights as a mapping of checkpoint keys (`q_proj.weight`, ...) to tensors and
compute in float64 whatever dtype they are given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from model.config import MHAConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
Past = tuple[torch.Tensor, torch.Tensor]  # a decode step's past keys and values, (B, nh, P, hs) each
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # queries, keys, values, split into heads


def _linear(x: torch.Tensor, weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    w = weights[f"{name}.weight"].to(torch.float64)
    y = x @ w.T
    bias = weights.get(f"{name}.bias")
    return y + bias.to(torch.float64) if bias is not None else y


def split_heads(y: torch.Tensor, config: MHAConfig) -> torch.Tensor:
    """(B, T, C) split into heads."""
    B, T, _ = y.shape
    return y.view(B, T, config.n_head, config.head_size).transpose(1, 2)  # (B, nh, T, hs)


def heads(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig, name: str) -> torch.Tensor:
    """(B, T, C) projected by `name` in float64 and split into heads."""
    return split_heads(_linear(x.to(torch.float64), weights, name), config)  # (B, nh, T, hs)


def _qkv(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig, past: Past | None) -> QKV:
    """The queries of `x`'s tokens (B, nh, T, hs), and the keys and values they attend to: the
    past's, as given, then their own (B, nh, P + T, hs)."""
    q, k, v = (heads(x, weights, config, name) for name in PROJECTIONS[:3])  # (B, nh, T, hs) each
    if past is not None:
        k, v = (torch.cat([held.to(torch.float64), new], dim=2) for held, new in zip(past, (k, v), strict=True))
    return q, k, v


def causal_mask(T: int, past: int = 0) -> torch.Tensor:
    """(T, past + T) bool, True where new token t (position past + t) may attend to position s
    (s <= past + t)."""
    return torch.tril(torch.ones(T, past + T, dtype=torch.bool), diagonal=past)


def attention_view(
    x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig, past: Past | None = None
) -> torch.Tensor:
    """The view / transpose / masked_fill / softmax formulation. With `past`, `x` holds a decode
    step's new tokens, which attend to the past keys and values as given and to themselves."""
    x = x.to(torch.float64)
    B, T, C = x.shape
    q, k, v = _qkv(x, weights, config, past)  # (B, nh, T, hs), (B, nh, P + T, hs) twice
    att = (q @ k.transpose(-2, -1)) / math.sqrt(config.head_size)  # (B, nh, T, P + T)
    if config.causal:
        att = att.masked_fill(~causal_mask(T, k.shape[2] - T), torch.finfo(att.dtype).min)
    att = torch.softmax(att, dim=-1)
    y = att @ v  # (B, nh, T, hs)
    y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
    return _linear(y, weights, "o_proj")


def _probabilities(q: torch.Tensor, k: torch.Tensor, config: MHAConfig) -> torch.Tensor:
    """The attention weights (B, nh, T, P + T) of queries (B, nh, T, hs) over keys (B, nh, P + T, hs)."""
    T = q.shape[2]
    scores = q @ k.transpose(-2, -1)  # (B, nh, T, P + T), times sqrt(hs)
    if config.causal:
        scores = scores.masked_fill(~causal_mask(T, k.shape[2] - T), -math.inf)
    return torch.softmax(scores / math.sqrt(config.head_size), dim=-1)


def _merged(y: torch.Tensor) -> torch.Tensor:
    B, nh, T, hs = y.shape
    return y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C)


def term_magnitudes(x: torch.Tensor, weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """|x| |W|^T + |b| of the linear layer `name`: the size of the terms each of its sums adds,
    in float64. A format rounds a sum at that size, however much the terms cancel."""
    w = weights[f"{name}.weight"].to(torch.float64).abs()
    y = x.to(torch.float64).abs() @ w.T
    bias = weights.get(f"{name}.bias")
    return y + bias.to(torch.float64).abs() if bias is not None else y


def score_rounding_error(
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    config: MHAConfig,
    past: Past | None = None,
    roundoff: float | None = None,
) -> float:
    """How far rounding the attention scores moves the answer: ||dy|| / ||y|| when each score may
    be off by one unit of the size its dot product reaches, |q| |k| / sqrt(hs) (a sum that cancels
    is rounded at the size of its terms). To first order (in units of u): a score off by e_ij moves
    a head's row i by sum_j p_ij e_ij (v_j - y_i), nothing where the softmax is sure, most where it
    weighs distant values alike. With `roundoff` (u, or a multiple of it), not to first order: a
    row whose scores may each be off by E lets each weight grow or shrink by up to exp(2 E), and
    move by at most all of itself, which covers scores so large that their rounding can reorder
    near ties (where the first order says nothing moves). Heads fill columns of their own; o_proj
    scales by its spectral norm. `past` as attention_view's."""
    x = x.to(torch.float64)
    q, k, v = _qkv(x, weights, config, past)  # (B, nh, T, hs), (B, nh, P + T, hs) twice
    T = q.shape[2]
    reach = q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :]  # (B, nh, T, P + T), times sqrt(hs)
    error = reach / math.sqrt(config.head_size)  # (B, nh, T, P + T): each score's, in units of u
    if config.causal:
        error = error.masked_fill(~causal_mask(T, k.shape[2] - T), 0.0)
    p = _probabilities(q, k, config)  # (B, nh, T, P + T)
    y = p @ v  # (B, nh, T, hs)
    square = (v * v).sum(-1)[..., None, :] + (y * y).sum(-1)[..., :, None] - 2 * (y @ v.transpose(-2, -1))
    distance = square.clamp_min(0).sqrt()  # (B, nh, T, P + T): |v_j - y_i|
    if roundoff is None:
        moved = (p * error * distance).sum(-1)  # (B, nh, T)
    else:
        grow = torch.expm1((2 * roundoff * error.amax(-1, keepdim=True)).clamp_max(700.0))  # (B, nh, T, 1)
        moved = ((p * grow).clamp_max(1.0) * distance).sum(-1)  # (B, nh, T)
    o_norm = torch.linalg.matrix_norm(weights["o_proj.weight"].to(torch.float64), ord=2)
    size = float(_linear(_merged(y), weights, "o_proj").norm())  # the answer's
    return float(o_norm * moved.norm()) / size if size > 0 else 0.0


def linear_rounding_error(
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    config: MHAConfig,
    past: Past | None = None,
    past_terms: torch.Tensor | None = None,
) -> float:
    """How far rounding the sums of the linear layers may move the answer: ||y_abs|| / ||y||, y_abs
    the size of the terms carried through (v_proj's, the attention weights over those, o_proj's;
    `term_magnitudes`). The values' and the output's sums are rounded at the size of their terms,
    so an input whose terms cancel (one made to answer near zero) is answered off by u times
    y_abs, however small the answer. `past` as attention_view's; `past_terms` the size of its
    values' terms (B, nh, P, hs), where they were computed from tokens (else their magnitudes)."""
    x = x.to(torch.float64)
    q, k, v = _qkv(x, weights, config, past)  # (B, nh, T, hs), (B, nh, P + T, hs) twice
    v_abs = split_heads(term_magnitudes(x, weights, "v_proj"), config)  # (B, nh, T, hs)
    if past is not None:
        held = past[1].to(torch.float64).abs() if past_terms is None else past_terms
        v_abs = torch.cat([held, v_abs], dim=2)  # (B, nh, P + T, hs)
    p = _probabilities(q, k, config)  # (B, nh, T, P + T)
    terms = float(term_magnitudes(_merged(p @ v_abs), weights, "o_proj").norm())
    size = float(_linear(_merged(p @ v), weights, "o_proj").norm())  # the answer's
    return terms / size if size > 0 else terms


def attention_einsum(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig) -> torch.Tensor:
    """The einsum formulation, one head at a time."""
    x = x.to(torch.float64)
    T = x.shape[1]
    hs = config.head_size
    q, k, v = (_linear(x, weights, name) for name in PROJECTIONS[:3])  # (B, T, C) each
    heads = []
    for h in range(config.n_head):
        cols = slice(h * hs, (h + 1) * hs)
        qh, kh, vh = q[..., cols], k[..., cols], v[..., cols]  # (B, T, hs)
        scores = torch.einsum("bik,bjk->bij", qh, kh) / math.sqrt(hs)  # (B, T, T)
        if config.causal:
            scores = scores.masked_fill(~causal_mask(T), float("-inf"))
        weights_h = torch.softmax(scores, dim=-1)  # (B, T, T)
        heads.append(torch.einsum("bij,bjd->bid", weights_h, vh))  # (B, T, hs)
    y = torch.cat(heads, dim=-1)  # (B, T, C)
    return _linear(y, weights, "o_proj")


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref||, in float64."""
    y64, ref64 = y.to(torch.float64), ref.to(torch.float64)
    denom = torch.linalg.vector_norm(ref64).item()
    diff = torch.linalg.vector_norm(y64 - ref64).item()
    return diff / denom if denom > 0 else diff
