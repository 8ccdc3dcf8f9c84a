"""`mha infer` and `mha bench` against a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.cli import main as mha
from tests.support import ServerThread, make_settings


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as s:
        yield s


def test_infer_from_and_to_npy(
    server: ServerThread, small_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(0).standard_normal((2, 11, 32), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    assert (
        mha(["infer", "--url", server.url, "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")])
        == 0
    )
    out = capsys.readouterr().out
    assert "input [2, 11, 32] -> output [2, 11, 32]" in out and "checksum" in out
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    y = np.load(tmp_path / "y.npy")
    assert relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config)) < 1e-5


def test_infer_random_and_errors(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert mha(["infer", "--url", server.url, "--shape", "1,4,32"]) == 0
    assert "output [1, 4, 32]" in capsys.readouterr().out
    assert mha(["infer", "--url", server.url, "--shape", "1,4,31"]) == 1
    assert mha(["infer", "--url", server.url, "--shape", "one,4"]) == 2


def test_bench(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "bench",
        "--url",
        server.url,
        "--concurrency",
        "2",
        "--seconds",
        "1",
        "--seq-lens",
        "4,9",
        "--d-model",
        "32",
    ]
    assert mha(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] > 0 and result["errors"] == {} and result["p99_ms"] >= result["p50_ms"] > 0
