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


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """C=32, 4 heads, max_seq_len 64, causal; exported and verified."""
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    out = tmp_path_factory.mktemp("small-model")
    export_model_dir(out, SMALL, init_weights(SMALL, seed=3))
    return out


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default config (C=128, 8 heads, max_seq_len 1024), seed 0: what `make serve` serves."""
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    config = MHAConfig()
    out = tmp_path_factory.mktemp("default-model")
    export_model_dir(out, config, init_weights(config, seed=0))
    return out
