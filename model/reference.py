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


def _linear(x: torch.Tensor, weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    w = weights[f"{name}.weight"].to(torch.float64)
    y = x @ w.T
    bias = weights.get(f"{name}.bias")
    return y + bias.to(torch.float64) if bias is not None else y


def _heads(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig, name: str) -> torch.Tensor:
    """(B, T, C) projected by `name` and split into heads."""
    B, T, _ = x.shape
    return _linear(x, weights, name).view(B, T, config.n_head, config.head_size).transpose(1, 2)  # (B, nh, T, hs)


def causal_mask(T: int) -> torch.Tensor:
    """(T, T) bool, True where position t may attend to position s (s <= t)."""
    return torch.tril(torch.ones(T, T, dtype=torch.bool))


def attention_view(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig) -> torch.Tensor:
    """The view / transpose / masked_fill / softmax formulation."""
    x = x.to(torch.float64)
    B, T, C = x.shape
    q, k, v = (_heads(x, weights, config, name) for name in PROJECTIONS[:3])  # (B, nh, T, hs) each
    att = (q @ k.transpose(-2, -1)) / math.sqrt(config.head_size)  # (B, nh, T, T)
    if config.causal:
        att = att.masked_fill(~causal_mask(T), torch.finfo(att.dtype).min)
    att = torch.softmax(att, dim=-1)
    y = att @ v  # (B, nh, T, hs)
    y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
    return _linear(y, weights, "o_proj")


def score_rounding_error(x: torch.Tensor, weights: Mapping[str, torch.Tensor], config: MHAConfig) -> float:
    """How far rounding the attention scores moves the answer, to first order: ||dy|| / ||y|| when
    each score may be off by one unit of the size its dot product reaches, |q| |k| / sqrt(hs)
    (a sum that cancels is rounded at the size of its terms). A score off by e_ij moves a head's
    row i by sum_j p_ij e_ij (v_j - y_i): nothing where the softmax is sure, most where it weighs
    distant values alike. Heads fill columns of their own; o_proj scales by its spectral norm."""
    x = x.to(torch.float64)
    B, T, C = x.shape
    q, k, v = (_heads(x, weights, config, name) for name in PROJECTIONS[:3])  # (B, nh, T, hs) each
    reach = q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :]  # (B, nh, T, T), times sqrt(hs)
    p = q @ k.transpose(-2, -1)  # (B, nh, T, T), times sqrt(hs)
    if config.causal:
        p = p.masked_fill(~causal_mask(T), -math.inf)
    p = torch.softmax(p / math.sqrt(config.head_size), dim=-1)
    y = p @ v  # (B, nh, T, hs)
    square = (v * v).sum(-1)[..., None, :] + (y * y).sum(-1)[..., :, None] - 2 * (y @ v.transpose(-2, -1))
    moved = (p * reach * square.clamp_min(0).sqrt()).sum(-1) / math.sqrt(config.head_size)  # (B, nh, T)
    o_norm = torch.linalg.matrix_norm(weights["o_proj.weight"].to(torch.float64), ord=2)
    size = float(_linear(y.transpose(1, 2).contiguous().view(B, T, C), weights, "o_proj").norm())  # the answer's
    return float(o_norm * moved.norm()) / size if size > 0 else 0.0


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
