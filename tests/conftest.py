"""Shared fixtures: small exported model directories, built once per session."""

from __future__ import annotations

import gc
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# ONNX Runtime reads this once, when it is imported: the suite's in-process sessions then neither
# keep a database under ~/.cache nor send usage events, as `mha` itself does not (cli.main)
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

import pytest
from filelock import FileLock

from export.pipeline import export_model_dir
from model import MHAConfig
from model.checkpoint import init_weights

SMALL = MHAConfig(d_model=32, n_head=4, max_seq_len=64)


@pytest.fixture(scope="session", autouse=True)
def _temporary_folders_in_the_sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temporary folders (the supervisor's sockets and metrics folders among them) go into this
    session's folder, which pytest removes after three more sessions, not into /tmp for good: a
    supervisor a test kills with SIGKILL cannot remove them, nor can one a unit test only builds."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))  # servers the tests start inherit it
    patch.setattr(tempfile, "tempdir", None)  # this process finds it again: gettempdir() caches its first
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _heap_unfrozen_after_each_test() -> Iterator[None]:
    """A server run in this process freezes its heap at each load (service.engine.loading): the
    tests after it collect as usual."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def small_config() -> MHAConfig:
    return SMALL


def exported(
    tmp_path_factory: pytest.TempPathFactory, name: str, config: MHAConfig, seed: int, shared: bool = False
) -> Path:
    """A model directory of `config` with seed `seed`'s weights, exported and verified once per test
    process, or with `shared` once for all the session's test processes (pytest-xdist's), whichever
    asks first exporting under a file lock: then no test may write into it, nor find processes by
    its path (test_tune does, by small_model_dir's)."""
    root = tmp_path_factory.getbasetemp()
    if shared and os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder above each test process's own: the whole session's
    out = root / name
    with FileLock(root / f"{name}.lock"):
        if not (out / "manifest.json").is_file():  # written last, once the files are in place
            logging.getLogger("onnx_ir").setLevel(logging.WARNING)
            export_model_dir(out, config, init_weights(config, seed=seed))
    return out


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """C=32, 4 heads, max_seq_len 64, causal; exported and verified."""
    return exported(tmp_path_factory, "small-model", SMALL, seed=3)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default config (C=128, 8 heads, max_seq_len 1024), seed 0: what `make serve` serves.
    Shared by the session's test processes (its export is about 20 s of CPU)."""
    return exported(tmp_path_factory, "default-model", MHAConfig(), seed=0, shared=True)
