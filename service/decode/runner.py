"""Decode steps of live sequences on PyTorch: the new tokens' projections for every sequence of a
batch in one matmul each, attention of each sequence over its own cache (no copy of the cache,
whatever the lengths), and one output projection. On a CUDA device the caches stay in device
memory: a step moves only its new tokens in and their outputs out."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from model import MHAConfig
from model.attention import cached_attention
from model.checkpoint import Weights
from service.backends.chain import is_sticky_device_error
from service.backends.pytorch import ServedAttention, one_thread, prepare_device
from service.batching import merge, split
from service.decode.sequences import Sequence
from service.errors import DeviceLost

ONE_THREAD_TOKENS = 16  # steps of at most this many new tokens (rows x t) run on one CPU thread


def step_device(serving_device: str) -> str:
    """Steps run on the device that serves the stateless requests when PyTorch reaches it (a CUDA
    build of torch on a CUDA machine), else on the CPU."""
    if serving_device.startswith("cuda") and torch.cuda.is_available():
        return serving_device
    return "cpu"


@dataclass(frozen=True)
class StepInput:
    sequence: Sequence
    x: np.ndarray  # (B, t, C): the new tokens of each of the sequence's B rows


class StepRunner:
    """Computes steps and writes the new keys and values into each sequence's cache at
    [length, length + t); the caller commits `length` once the answer is delivered, so a step
    that fails or is abandoned leaves its sequence as it was."""

    def __init__(self, config: MHAConfig, weights: Weights, device: str = "cpu") -> None:
        self.config, self.device = config, device
        self.name = prepare_device(device)
        self.module = ServedAttention.from_weights(config, weights).to(device)  # q, k, v in one matmul
        self._one_token = OneTokenStep(config, self.module) if device == "cpu" else None

    def run(self, steps: Seq[StepInput]) -> list[np.ndarray]:
        """The outputs (B, t, C) of each step, in order. A sticky CUDA error raises DeviceLost:
        the caches on that device are gone with its context."""
        if self._one_token is not None and len(steps) == 1 and steps[0].x.shape[1] == 1:
            return [self._one_token(steps[0])]  # a lone sequence's next token: numpy, a third of the time
        tokens = sum(int(s.x.shape[0]) * int(s.x.shape[1]) for s in steps)
        try:
            with one_thread(self.device == "cpu" and tokens <= ONE_THREAD_TOKENS):
                return self._compute(steps)
        except Exception as exc:
            if is_sticky_device_error(self.device, exc):
                raise DeviceLost(f"{self.name} on {self.device}: {exc}") from exc
            raise

    @torch.inference_mode()
    def _compute(self, steps: Seq[StepInput]) -> list[np.ndarray]:
        x = torch.from_numpy(merge([s.x for s in steps])).to(self.device)  # (R, t_max, C), right-padded
        q, k, v = self.module.project(x)  # (R, nh, t_max, hs)
        if len(steps) == 1:
            heads = self._attend(steps[0].sequence, q, k, v)  # (R, nh, t, hs)
        else:
            heads = torch.zeros_like(q)  # (R, nh, t_max, hs)
            row = 0
            for step in steps:
                B, t = step.x.shape[0], step.x.shape[1]
                rows = slice(row, row + B)
                heads[rows, :, :t] = self._attend(step.sequence, q[rows, :, :t], k[rows, :, :t], v[rows, :, :t])
                row += B
        y = self.module.merge(heads).cpu().numpy()  # (R, t_max, C); a no-op on the CPU
        return split(y, [(s.x.shape[0], s.x.shape[1]) for s in steps])  # (B, t, C) each

    @staticmethod
    def _attend(sequence: Sequence, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, nh, t, hs) heads of the new tokens, their keys and values written into the cache."""
        P, t = sequence.length, q.shape[2]
        sequence.keys.narrow(2, P, t).copy_(k)  # [:, :, P : P + t], without the cost of indexing
        sequence.values.narrow(2, P, t).copy_(v)
        keys, values = sequence.keys.narrow(2, 0, P + t), sequence.values.narrow(2, 0, P + t)  # (B, nh, P + t, hs)
        if t == 1:  # one new token sees every key: no mask
            return F.scaled_dot_product_attention(q, keys, values)
        return cached_attention(q, keys, values, torch.full((q.shape[0],), P, device=q.device))


class OneTokenStep:
    """One new token of one sequence on the CPU, in numpy: StepRunner's arithmetic for t = 1 (one
    matmul for q, k and v; the new key and value written at the end of the cache; attention of the
    token over every key, no mask; o_proj) in a third of the time, because at this size each
    PyTorch op costs microseconds of dispatch (in process, default model: 18-27 us against 46-48 us
    with 10 to 250 tokens held). Batches of several sequences, and t > 1, stay on PyTorch."""

    def __init__(self, config: MHAConfig, module: ServedAttention) -> None:
        self.width, self.heads, self.head_size = config.d_model, config.n_head, config.head_size
        self.scale = np.float32(1.0 / np.sqrt(config.head_size))  # SDPA's default
        with torch.no_grad():
            self.qkv_weight = module.qkv_weight.t().contiguous().numpy()  # (C, 3C)
            self.qkv_bias = module.qkv_bias.numpy() if module.qkv_bias is not None else None  # (3C,)
            self.o_weight = module.o_proj.weight.t().contiguous().numpy()  # (C, C)
            self.o_bias = module.o_proj.bias.numpy() if module.o_proj.bias is not None else None  # (C,)

    def __call__(self, step: StepInput) -> np.ndarray:
        """(B, 1, C) -> (B, 1, C); the token's key and value written into the cache at `length`.
        NaN or inf in the input come out as NaN in its output, which the step's commit refuses."""
        with np.errstate(over="ignore", invalid="ignore"):  # an answer to refuse, not a warning on stderr
            return self._compute(step)

    def _compute(self, step: StepInput) -> np.ndarray:
        B, C, nh, hs = int(step.x.shape[0]), self.width, self.heads, self.head_size
        P = step.sequence.length
        qkv = step.x.reshape(B, C) @ self.qkv_weight  # (B, 3C)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        keys, values = step.sequence.keys.numpy(), step.sequence.values.numpy()  # (B, nh, capacity, hs), views
        keys[:, :, P] = qkv[:, C : 2 * C].reshape(B, nh, hs)
        values[:, :, P] = qkv[:, 2 * C :].reshape(B, nh, hs)
        q = qkv[:, :C].reshape(B, nh, 1, hs)  # (B, nh, 1, hs)
        scores = q @ keys[:, :, : P + 1].transpose(0, 1, 3, 2)  # (B, nh, 1, P + 1)
        scores *= self.scale
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        heads = scores @ values[:, :, : P + 1]  # (B, nh, 1, hs)
        y = heads.reshape(B, C) @ self.o_weight  # (B, C): the heads side by side, as merge() lays them
        if self.o_bias is not None:
            y += self.o_bias
        return y.reshape(B, 1, C)  # (B, 1, C)
