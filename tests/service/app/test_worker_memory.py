"""How many workers the memory allows: `auto` keeps their own memory to half the limit, an
explicit count that cannot fit is refused; and the estimate of a worker's memory against a real
worker's (tests/e2e/test_worker_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.app.supervisor import (
    SUPERVISOR_BYTES,
    WORKERS_SHARE,
    served_bytes,
    worker_bytes,
    workers_in_memory,
)
from service.settings import Settings

GIB = 2**30


def test_auto_starts_one_per_cpu_where_the_memory_allows_it() -> None:
    assert workers_in_memory("auto", 4, 0, 4 * GIB) == 4  # the default pod: 4 CPUs, 4 GiB


def test_auto_on_a_node_of_many_cpus_keeps_the_workers_to_half_the_memory() -> None:
    """A pod without a CPU limit sees every CPU of its node: 96 workers in 4 GiB would be killed
    for memory over and over. It starts as many as hold half of the limit."""
    each = worker_bytes(0)
    count = workers_in_memory("auto", 96, 0, 4 * GIB)
    assert count * each + SUPERVISOR_BYTES <= 4 * GIB * WORKERS_SHARE < (count + 1) * each + SUPERVISOR_BYTES
    assert workers_in_memory("auto", 96, 10 * GIB, 4 * GIB) == 1  # a model too large for two: one still starts


def test_an_explicit_count_is_kept_while_the_workers_fit() -> None:
    each = worker_bytes(50 * 2**20)
    assert workers_in_memory("3", 3, 50 * 2**20, 3 * each + SUPERVISOR_BYTES) == 3  # beyond auto's half: allowed
    assert workers_in_memory("1", 1, 50 * 2**20, each) == 1  # one worker is the server: no supervisor


def test_an_explicit_count_that_fits_only_without_its_supervisor_is_refused() -> None:
    each = worker_bytes(50 * 2**20)
    with pytest.raises(ValueError, match=f"for 3 and their supervisor's {SUPERVISOR_BYTES // 2**20} MiB; "):
        workers_in_memory("3", 3, 50 * 2**20, 3 * each + SUPERVISOR_BYTES - 1)


@pytest.mark.parametrize("count", [1000, 14])
def test_an_explicit_count_that_cannot_fit_is_refused_with_what_would(count: int) -> None:
    with pytest.raises(ValueError) as refused:
        workers_in_memory(str(count), count, 0, 4 * GIB)
    said = str(refused.value)
    assert f"--workers {count}: each worker holds about {worker_bytes(0) / 2**20:,.0f} MiB" in said
    fits = workers_in_memory("auto", count, 0, 4 * GIB)  # 5 at 352 MiB a worker
    assert "allows 4.0 GiB" in said and f"Give --workers auto ({fits} here" in said


def test_a_model_too_large_for_one_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="--workers 1: each worker holds about"):
        workers_in_memory("1", 1, 2 * GIB, 4 * GIB)


def test_the_served_bytes_are_the_model_directory_or_each_models_largest_version(tmp_path: Path) -> None:
    model = tmp_path / "dir"
    model.mkdir()
    (model / "model.onnx").write_bytes(b"x" * 1000)
    (model / "weights.safetensors").write_bytes(b"x" * 500)
    assert served_bytes(Settings(model_dir=model)) == 1500
    assert served_bytes(Settings(default_model_dir=tmp_path / "not-exported-yet")) == 0
    repository = tmp_path / "repo"
    for name, version, size in (("a", "1", 100), ("a", "2", 300), ("b", "1", 50)):
        (repository / name / version).mkdir(parents=True)
        (repository / name / version / "model.onnx").write_bytes(b"x" * size)
    (repository / "a" / "config.pbtxt").write_text("name: 'a'")
    assert served_bytes(Settings(model_repository=repository)) == 350
