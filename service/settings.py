"""One settings object for `mha serve`, built in main() from flags and MHA_* variables.

Every flag `--some-flag` also reads `MHA_SOME_FLAG`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0, true/false), got {text!r}")


@dataclass(frozen=True)
class Settings:
    model_dir: Path | None = None  # None: the default model, exported first if missing
    default_model_dir: Path = Path("models/default")  # where the default model lives
    model_name: str = "mha"
    model_version: str = "1"
    host: str = "0.0.0.0"
    grpc_port: int = 8001
    metrics_port: int = 8002  # 0 disables the /metrics endpoint
    backend: str = "auto"  # auto | ort-cuda | ort-cpu | torch
    threads: int = 0  # intra-op threads for CPU backends; 0: the CPUs this process may use
    max_batch_size: int = 8  # rows per executed batch; 1 turns batching off
    max_queue_delay_ms: float = 2.0  # milliseconds the first request of a batch waits for company
    max_queue_size: int = 256  # requests (not rows) waiting; beyond: RESOURCE_EXHAUSTED
    max_padding_ratio: float = 0.25  # padded tokens / batch tokens allowed when merging T
    max_request_rows: int = 256  # largest B accepted in one request
    max_message_mb: int = 64  # MiB per gRPC message, each way; beyond: RESOURCE_EXHAUSTED
    grace_s: float = 20.0  # seconds in-flight requests get to finish on SIGTERM
    fallback_failures: int = 3  # consecutive failures that bench a backend
    fallback_cooldown_s: float = 30.0  # seconds a benched backend waits before its probe
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients must present a certificate it signed (mTLS)
    auth_token_file: Path | None = None  # set: `authorization: Bearer <token>` required
    log_format: str = "json"  # json | text
    log_level: str = "INFO"

    @property
    def cpu_threads(self) -> int:
        if self.threads > 0:
            return self.threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def validate(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together; give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if self.backend not in ("auto", "ort-cuda", "ort-cpu", "torch"):
            raise ValueError(f"--backend {self.backend!r}: expected auto, ort-cuda, ort-cpu or torch")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"--log-format {self.log_format!r}: expected json or text")
        for name in ("max_batch_size", "max_queue_size", "max_request_rows", "max_message_mb", "fallback_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queue_delay_ms", "grace_s", "fallback_cooldown_s", "max_padding_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


_HELP = {
    "model_dir": "model directory from `mha export` (default: the default model, exported if missing)",
    "default_model_dir": "where the default model is kept",
    "host": "address to bind (default 0.0.0.0)",
    "grpc_port": "gRPC port (default 8001)",
    "metrics_port": "Prometheus /metrics port, 0 to disable (default 8002)",
    "backend": "auto, ort-cuda, ort-cpu or torch (default auto)",
    "threads": "intra-op threads for CPU backends, 0 for all CPUs available (default 0)",
    "max_batch_size": "rows per executed batch, 1 turns batching off (default 8)",
    "max_queue_delay_ms": "ms the first request of a batch waits for more (default 2)",
    "max_queue_size": "requests waiting before RESOURCE_EXHAUSTED (default 256)",
    "max_padding_ratio": "padded share of a batch's tokens when merging different T (default 0.25)",
    "max_request_rows": "largest B in one request (default 256)",
    "max_message_mb": "MiB per gRPC message before RESOURCE_EXHAUSTED (default 64)",
    "grace_s": "seconds in-flight requests get on SIGTERM (default 20)",
    "fallback_failures": "consecutive failures that bench a backend (default 3)",
    "fallback_cooldown_s": "seconds a benched backend waits before its probe (default 30)",
    "tls_cert": "PEM server certificate (with --tls-key) to serve TLS",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle; clients must present a certificate it signed (mTLS)",
    "auth_token_file": "file holding the bearer token clients must send",
    "log_format": "json or text (default json)",
}


def add_serve_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """One flag per Settings field (but log_level, a global flag), defaulting to MHA_<NAME>."""
    defaults = Settings()
    for f in fields(Settings):
        if f.name == "log_level":
            continue
        default = getattr(defaults, f.name)
        kind = _kind(f.type)
        env = environ.get(f"MHA_{f.name.upper()}")
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=kind,
            default=kind(env) if env is not None else default,
            help=f"{_HELP.get(f.name, f.name)} [env MHA_{f.name.upper()}]",
        )


def _kind(annotation: object) -> Callable[[str], Any]:
    text = str(annotation)
    if "Path" in text:
        return Path
    if "bool" in text:
        return _bool
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


def settings_from_namespace(ns: argparse.Namespace, log_level: str) -> Settings:
    values = {f.name: getattr(ns, f.name) for f in fields(Settings) if f.name != "log_level"}
    settings = Settings(**values, log_level=log_level)
    settings.validate()
    return settings
