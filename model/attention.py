"""The causal multi-head self-attention module, as the reference texts write it."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from model.config import MHAConfig


class MultiHeadAttention(nn.Module):
    """q/k/v projections, scaled dot-product attention per head, output projection.

    `fast=True` computes attention with `F.scaled_dot_product_attention` (what serving and
    export use); `fast=False` is the plain path of the reference texts, kept beside it.
    """

    def __init__(self, config: MHAConfig, fast: bool = True) -> None:
        super().__init__()
        self.config = config
        self.fast = fast
        C = config.d_model
        self.q_proj = nn.Linear(C, C, bias=config.bias)
        self.k_proj = nn.Linear(C, C, bias=config.bias)
        self.v_proj = nn.Linear(C, C, bias=config.bias)
        self.o_proj = nn.Linear(C, C, bias=config.bias)

    @classmethod
    def from_weights(
        cls, config: MHAConfig, weights: Mapping[str, torch.Tensor], fast: bool = True
    ) -> MultiHeadAttention:
        """A module in eval mode holding `weights` (checkpoint keys), in float32."""
        module = cls(config, fast=fast)
        module.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()})
        return module.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)  # (B, nh, T, hs) each
        if self.fast:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.config.causal)
        else:
            y = self._plain_attention(q, k, v)  # (B, nh, T, hs)
        return self.merge(y)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v, each (B, nh, T, hs)."""
        B, T, _ = x.shape
        nh, hs = self.config.n_head, self.config.head_size
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        return q, k, v

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hs) per head -> (B, T, C) through o_proj."""
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).contiguous().view(B, T, self.config.d_model)  # (B, T, C)
        return self.o_proj(y)

    def _plain_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, T)
        if self.config.causal:
            future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # (T, T)
            att = att.masked_fill(future, torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        return att @ v  # (B, nh, T, hs)


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """Causal attention of new queries over cached keys, aligned to each row's own position.

    q (R, nh, t, hs) are the queries of tokens at positions past[r] + i; keys and values
    (R, nh, L, hs) hold every earlier token of row r and these ones at [0, past[r] + t). Key j is
    visible to query i iff j <= past[r] + i, so padding beyond a row's length is never seen.
    """
    R, _, t, _ = q.shape
    L = keys.size(2)
    position = past.view(R, 1, 1) + torch.arange(t, device=q.device).view(1, t, 1)  # (R, t, 1)
    visible = torch.arange(L, device=q.device).view(1, 1, L) <= position  # (R, t, L)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible.unsqueeze(1))  # (R, nh, t, hs)
