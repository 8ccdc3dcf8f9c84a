"""The estimate `--workers` is bounded by (service/app/supervisor.py: worker_bytes) against a real
worker's own resident memory, once loaded and after a load of the longest requests: never below
it (or workers that the memory cannot hold would start), and within 1.6x of it (or fewer workers
would start than fit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model import MHAConfig
from service.app.supervisor import served_bytes, worker_bytes
from service.client.loadgen import run_load
from service.settings import Settings
from tests.conftest import exported
from tests.support import ServerProcess, own_memory_bytes

WIDE = MHAConfig(d_model=1024, n_head=8, max_seq_len=64)  # 50 MB of model files: the per-byte part shows


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exported(tmp_path_factory, "wide-model", WIDE, seed=1)


@pytest.mark.parametrize("which", ["default", "wide"])
def test_a_workers_memory_is_within_its_estimate(
    which: str, default_model_dir: Path, wide_model_dir: Path, tmp_path: Path
) -> None:
    model_dir, config = (default_model_dir, MHAConfig()) if which == "default" else (wide_model_dir, WIDE)
    server = ServerProcess(["--model-dir", str(model_dir)]).start(tmp_path / "server.log")
    try:
        assert server.proc is not None
        loaded = own_memory_bytes(server.proc.pid)
        T = min(config.max_seq_len, 512)
        result = run_load(server.url, 4, 1.5, [T], batch=2, d_model=config.d_model)
        assert result.requests > 0 and not result.errors, result
        used = max(loaded, own_memory_bytes(server.proc.pid))
    finally:
        server.kill()
    estimate = worker_bytes(served_bytes(Settings(model_dir=model_dir)))
    assert used <= estimate <= 1.6 * used, (which, loaded, used, estimate)
