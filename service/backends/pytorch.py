"""PyTorch eager from weights.safetensors, on CUDA when present."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from model import MHAConfig, MultiHeadAttention
from model.checkpoint import Weights
from service.backends.base import Backend, BackendLoadError

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


class TorchBackend(Backend):
    platform = "pytorch_libtorch"

    def __init__(
        self,
        config: MHAConfig,
        weights: Weights,
        device: str = "cpu",
        threads: int | None = None,
        precision: str = "fp32",
    ) -> None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendLoadError("torch sees no CUDA device")
        if threads and not device.startswith("cuda"):
            torch.set_num_threads(threads)
        self.device = device
        self.name = prepare_device(device)
        self.dtype = PRECISIONS[precision]  # float32 in and out; computed in this dtype
        self._module = MultiHeadAttention.from_weights(config, weights).to(device, self.dtype)

    @torch.inference_mode()
    def run(self, x: np.ndarray) -> np.ndarray:
        if not x.flags.writeable:  # a view of a request's bytes: torch warns on (and may not) share it
            x = x.copy()
        xt = torch.from_numpy(x).to(self.device, self.dtype, non_blocking=True)
        return self._module(xt).float().cpu().numpy()
