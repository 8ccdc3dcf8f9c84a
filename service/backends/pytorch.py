"""PyTorch eager from weights.safetensors, on CUDA when present."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model import MHAConfig, MultiHeadAttention
from model.attention import cached_attention
from model.checkpoint import Weights
from service.backends.base import Backend, BackendLoadError, KVCache, Step
from service.backends.crossover import measure_crossover
from service.batching import merge, split

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def prepare_device(device: str) -> str:
    """Set PyTorch up to serve on `device` and name what serves there: TF32 off on CUDA (fp32
    parity with the reference); inputs may be read-only views of request bytes, which nothing
    writes to, so PyTorch's warning about them is silenced."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    return "torch-cuda" if device.startswith("cuda") else "torch-cpu"


@contextlib.contextmanager
def one_thread(wanted: bool) -> Iterator[None]:
    """PyTorch on one intra-op thread for the duration, when `wanted`: a small batch's ops are too
    small to share, and waking the sleeping pool for each of them costs more than it saves. The
    setting is changed for the calling thread (other running threads keep theirs) and restored
    on exit."""
    threads = torch.get_num_threads()
    if not wanted or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ServedAttention(nn.Module):
    """MultiHeadAttention as PyTorch serves it: the same arithmetic in fewer kernels. The three
    projections of x are one linear against [Wq; Wk; Wv] (each output column is the same dot
    product as before), attention is SDPA's, then o_proj: a small request pays each kernel's
    dispatch, so fewer kernels answer it sooner (docs/operations.md)."""

    qkv_weight: torch.Tensor  # (3C, C), a buffer: moves with .to()
    qkv_bias: torch.Tensor | None  # (3C,)

    def __init__(self, module: MultiHeadAttention) -> None:
        super().__init__()
        self.config = module.config
        projections = (module.q_proj, module.k_proj, module.v_proj)
        self.register_buffer("qkv_weight", torch.cat([p.weight.detach() for p in projections]))  # (3C, C)
        biases = [p.bias.detach() for p in projections if p.bias is not None]
        self.register_buffer("qkv_bias", torch.cat(biases) if biases else None)  # (3C,)
        self.o_proj = module.o_proj

    @classmethod
    def from_weights(cls, config: MHAConfig, weights: Weights) -> ServedAttention:
        return cls(MultiHeadAttention.from_weights(config, weights)).eval()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v, each (B, nh, T, hs): MultiHeadAttention.project in one matmul."""
        B, T, _ = x.shape
        nh, hs = self.config.n_head, self.config.head_size
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # (B, T, 3C): q, k, v side by side
        q, k, v = qkv.view(B, T, 3, nh, hs).permute(2, 0, 3, 1, 4).unbind(0)  # (B, nh, T, hs) each
        return q, k, v

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hs) per head -> (B, T, C) through o_proj."""
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.config.d_model))  # (B, T, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)  # (B, nh, T, hs) each
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.config.causal))


class TorchBackend(Backend):
    platform = "pytorch_libtorch"

    def __init__(
        self,
        config: MHAConfig,
        weights: Weights,
        device: str = "cpu",
        threads: int | None = None,
        precision: str = "fp32",
        single_max_tokens: int | None = None,
    ) -> None:
        """`single_max_tokens`: the crossover another start measured (None: measure it here)."""
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendLoadError("torch sees no CUDA device")
        if threads and not device.startswith("cuda"):
            torch.set_num_threads(threads)
        self.device = device
        self.name = prepare_device(device)
        self.dtype = PRECISIONS[precision]  # float32 in and out; computed in this dtype
        self._module = ServedAttention.from_weights(config, weights).to(device, self.dtype)
        # decode steps in float32 whatever the precision, as the caches are kept
        fp32 = self.dtype == torch.float32
        self._step_module = self._module if fp32 else ServedAttention.from_weights(config, weights).to(device)
        # Small batches on one thread when that measures about as fast as the pool, as ORT-CPU's
        # (service/backends/crossover.py): rows x T up to this many tokens.
        self.single_max_tokens = 0
        if device == "cpu" and torch.get_num_threads() > 1:
            if single_max_tokens is None:
                single_max_tokens = measure_crossover(self._one_thread, self._compute, config.d_model)
            self.single_max_tokens = single_max_tokens
            log.debug("torch-cpu: batches of up to %d tokens run on one thread", self.single_max_tokens)

    def run(self, x: np.ndarray) -> np.ndarray:
        if not x.flags.writeable:  # a view of a request's bytes: torch warns on (and may not) share it
            x = x.copy()
        if int(x.shape[0]) * int(x.shape[1]) <= self.single_max_tokens:
            return self._one_thread(x)
        return self._compute(x)

    def _one_thread(self, x: np.ndarray) -> np.ndarray:
        with one_thread(True):
            return self._compute(x)

    @torch.inference_mode()
    def _compute(self, x: np.ndarray) -> np.ndarray:
        xt = torch.from_numpy(x).to(self.device, self.dtype, non_blocking=True)
        return self._module(xt).float().cpu().numpy()

    @property
    def steps(self) -> bool:
        return True

    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        tokens = sum(int(s.x.shape[0]) * int(s.x.shape[1]) for s in steps)
        with one_thread(tokens <= self.single_max_tokens):
            return self._step(steps)

    @torch.inference_mode()
    def _step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        """The new tokens' projections for every sequence of the batch in one matmul, attention of
        each sequence over its own cache (no copy of the cache, whatever the lengths), and one
        output projection."""
        module = self._step_module
        merged = merge([s.x for s in steps])  # (R, t_max, C), right-padded
        if not merged.flags.writeable:  # a view of a request's bytes, as `run` meets it
            merged = merged.copy()
        x = torch.from_numpy(merged).to(self.device)
        q, k, v = module.project(x)  # (R, nh, t_max, hs)
        heads = torch.zeros_like(q)  # (R, nh, t_max, hs)
        row = 0
        for step in steps:
            B, t = step.x.shape[0], step.x.shape[1]
            rows = slice(row, row + B)
            heads[rows, :, :t] = _attend(step.cache, q[rows, :, :t], k[rows, :, :t], v[rows, :, :t])
            row += B
        y = module.merge(heads).cpu().numpy()  # (R, t_max, C); a no-op on the CPU
        return split(y, [(s.x.shape[0], s.x.shape[1]) for s in steps])  # (B, t, C) each


def _attend(cache: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, nh, t, hs) heads of the new tokens, their keys and values written into the cache."""
    P, t = cache.length, q.shape[2]
    cache.keys.narrow(2, P, t).copy_(k)  # [:, :, P : P + t]
    cache.values.narrow(2, P, t).copy_(v)
    keys, values = cache.keys.narrow(2, 0, P + t), cache.values.narrow(2, 0, P + t)  # (B, nh, P + t, hs)
    if t == 1:  # one new token sees every key: no mask
        return F.scaled_dot_product_attention(q, keys, values)
    return cached_attention(q, keys, values, torch.full((q.shape[0],), P, device=q.device))
