"""Flags and MHA_* variables build one Settings object; bad combinations are refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.settings import Settings, add_serve_arguments, settings_from_namespace


def _parse(argv: list[str], environ: dict[str, str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ)
    return settings_from_namespace(parser.parse_args(argv), "INFO")


def test_defaults_follow_the_design() -> None:
    s = _parse([], {})
    assert (s.grpc_port, s.metrics_port, s.backend, s.model_name, s.model_version) == (8001, 8002, "auto", "mha", "1")


def test_env_and_flags() -> None:
    env = {
        "MHA_GRPC_PORT": "9001",
        "MHA_MAX_QUEUE_DELAY_MS": "0.5",
        "MHA_MODEL_DIR": "/models/x",
        "MHA_BACKEND": "torch",
    }
    s = _parse([], env)
    assert (s.grpc_port, s.max_queue_delay_ms, s.model_dir, s.backend) == (9001, 0.5, Path("/models/x"), "torch")
    assert _parse(["--grpc-port", "7001"], env).grpc_port == 7001  # the flag wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-cert", "c.pem"], "go together"),
        (["--tls-client-ca", "ca.pem"], "needs --tls-cert"),
        (["--backend", "tpu"], "expected auto, ort-cuda, ort-cpu or torch"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        (["--grace-s", "-1"], "--grace-s must be >= 0"),
    ],
)
def test_invalid_settings(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(argv, {})


def test_cpu_threads_default_to_the_cpus_available() -> None:
    assert Settings().cpu_threads >= 1
    assert Settings(threads=3).cpu_threads == 3
