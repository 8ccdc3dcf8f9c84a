"""On a machine with a CUDA device: ORT-CUDA confirmed, parity, and auto picks it. Skipped without one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from export.layout import ModelFiles
from export.verify import check_parity, parity_grid
from model.checkpoint import load_checkpoint
from service.backends.selection import BackendSpec, select_backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.py runs these on one)"
    ),
]


def test_ort_cuda_provider_confirmed_and_exact(default_model_dir: Path) -> None:
    from service.backends.ort import OrtCudaBackend

    backend = OrtCudaBackend(ModelFiles(default_model_dir).onnx)
    assert backend.providers[0] == "CUDAExecutionProvider"
    config, weights = load_checkpoint(default_model_dir / "weights.safetensors")
    report = check_parity(backend.run, config, weights, parity_grid(config.max_seq_len), seed=5)
    assert report.ok, report.table()


def test_auto_races_ort_cuda_and_torch_cuda_and_falls_back_to_the_cpu(default_model_dir: Path) -> None:
    config, weights = load_checkpoint(default_model_dir / "weights.safetensors")
    selection = select_backends(BackendSpec(ModelFiles(default_model_dir).onnx, config, weights), "auto")
    names = [b.name for b in selection.backends]
    assert sorted(names[:2]) == ["ort-cuda", "torch-cuda"] and names[2:] == ["ort-cpu", "torch-cpu"]
    assert all("probe" in c.reason for c in selection.candidates if c.name.endswith("cuda")), selection.summary()
    y = selection.backends[0].run(np.ones((2, 8, config.d_model), np.float32))
    assert y.shape == (2, 8, config.d_model)
