"""Triton's perf_analyzer drives mha-serve in every mode a Triton user would benchmark with, to
completion, with the server's statistics reported: gRPC, HTTP, gRPC streaming, B > 1, a
request rate, a concurrency sweep, system shared memory over both protocols, and sequences (the
`mha_sequence` entry) over gRPC, gRPC streaming and HTTP. Each run is short: this proves the
protocol, not the speed (docs/benchmarks.md has the commands for a real measurement)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT, ServerProcess, server_process

PERF_ANALYZER = ROOT / ".venv-perf" / "bin" / "perf_analyzer"
LIBRARIES = [
    ROOT / ".tools" / "libb64" / "usr" / "lib" / "x86_64-linux-gnu",
    *sorted((ROOT / ".venv-perf" / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib")),
]
SHORT = ["--input-data", "zero", "--measurement-interval", "400", "--stability-percentage", "999", "--max-trials", "4"]
STATELESS = ["-m", "mha", "--shape", "x:64,128"]
SEQUENCES = ["-m", "mha_sequence", "--shape", "x:1,128", "--sequence-length", "8", "--concurrency-range", "3"]
MODES = {  # name: (protocol, arguments)
    "grpc": ("grpc", STATELESS),
    "http": ("http", STATELESS),
    "grpc-streaming": ("grpc", [*STATELESS, "--streaming"]),
    "batch-4": ("grpc", [*STATELESS, "-b", "4"]),
    "request-rate": ("grpc", [*STATELESS, "--request-rate-range", "100"]),
    "concurrency-sweep": ("grpc", [*STATELESS, "--concurrency-range", "1:4:3"]),
    "shared-memory-grpc": ("grpc", [*STATELESS, "--shared-memory", "system"]),
    "shared-memory-http": ("http", [*STATELESS, "--shared-memory", "system"]),
    "sequences-grpc": ("grpc", SEQUENCES),
    "sequences-streaming": ("grpc", [*SEQUENCES, "--streaming"]),
    "sequences-http": ("http", SEQUENCES),
}


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    assert PERF_ANALYZER.exists(), "make install creates .venv-perf with tritonclient 2.40.0's perf_analyzer"
    log = tmp_path_factory.mktemp("perf") / "server.log"
    with server_process(["--model-dir", str(default_model_dir), "--shared-memory", "system"], log) as s:
        yield s


@pytest.mark.parametrize("mode", MODES)
def test_perf_analyzer_runs_to_completion(server: ServerProcess, mode: str) -> None:
    protocol, arguments = MODES[mode]
    url = f"127.0.0.1:{server.port if protocol == 'grpc' else server.http_port}"
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(str(p) for p in LIBRARIES)}
    command = [str(PERF_ANALYZER), "-u", url, "-i", protocol, *SHORT, *arguments]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"{mode}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    assert "Server:" in run.stdout and "Successful request count" in run.stdout, run.stdout[-2000:]
    assert "Throughput:" in run.stdout


RUNS = 10  # perf_analyzer reads the statistics before and after each run, on connections of its own
BRIEF = [*SHORT[:2], "--measurement-interval", "150", *SHORT[4:]]  # each read is what matters, not the load


def test_perf_analyzer_over_http_at_concurrency_1_against_two_workers(default_model_dir: Path, tmp_path: Path) -> None:
    """Each HTTP statistics read may reach either worker: the replica's statistics are every
    worker's summed, so the counts perf_analyzer reads only grow (worker-local statistics went
    down between two reads, and perf_analyzer stopped: "failed to find the requested model
    version")."""
    args = ["--model-dir", str(default_model_dir), "--workers", "2"]
    with server_process(args, tmp_path / "server.log") as server:
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(str(p) for p in LIBRARIES)}
        url = f"127.0.0.1:{server.http_port}"
        command = [str(PERF_ANALYZER), "-u", url, "-i", "http", *BRIEF, *STATELESS, "--concurrency-range", "1"]
        failed = []
        for attempt in range(RUNS):
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            if run.returncode != 0:
                failed.append(f"run {attempt}: exit {run.returncode}: {(run.stdout + run.stderr)[-300:]}")
        assert failed == [], failed
