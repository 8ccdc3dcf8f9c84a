"""Shared fixtures: small exported model directories, built once per session."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from export.pipeline import export_model_dir
from model import MHAConfig
from model.checkpoint import init_weights

SMALL = MHAConfig(d_model=32, n_head=4, max_seq_len=64)


@pytest.fixture(scope="session")
def small_config() -> MHAConfig:
    return SMALL


def exported(tmp_path_factory: pytest.TempPathFactory, name: str, config: MHAConfig, seed: int) -> Path:
    """A model directory of `config` with seed `seed`'s weights, exported and verified."""
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    out = tmp_path_factory.mktemp(name)
    export_model_dir(out, config, init_weights(config, seed=seed))
    return out


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """C=32, 4 heads, max_seq_len 64, causal; exported and verified."""
    return exported(tmp_path_factory, "small-model", SMALL, seed=3)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default config (C=128, 8 heads, max_seq_len 1024), seed 0: what `make serve` serves."""
    return exported(tmp_path_factory, "default-model", MHAConfig(), seed=0)
