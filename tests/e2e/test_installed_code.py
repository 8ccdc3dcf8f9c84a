"""`mha serve` with its defaults (a worker per CPU), started in a folder that holds packages named
like ours: every process it starts runs the installed package, never the folder's. And ready
means ready: the moment any signal says so, every worker takes every sequence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.app.launch import free_ports
from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.resources import available_cpus

HOSTILE = ("service", "model", "export")
SEQUENCES = 48  # sequence starts sent the moment the server says it is ready, on connections of their own


def _hostile_folder(root: Path, marker: Path) -> Path:
    """A user's project with packages named like ours, each of which says it was imported."""
    project = root / "project"
    for name in HOSTILE:
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write('{name}\\n')\nraise SystemExit('the folder\\'s {name} was imported')\n"
        )
        (project / name / "cli.py").write_text("raise SystemExit('the folder\\'s cli was run')\n")
    return project


def _http_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def _first_ready(stub: pb_grpc.GRPCInferenceServiceStub, http_port: int, proc: subprocess.Popen[str]) -> str:
    """Ask ServerReady, ModelReady and HTTP ready in turn, as often as they answer; the first that
    says ready."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if stub.ServerReady(pb.ServerReadyRequest(), timeout=1).ready:
                return "ServerReady"
            if stub.ModelReady(pb.ModelReadyRequest(name="mha"), timeout=1).ready:
                return "ModelReady"
        except grpc.RpcError:
            pass
        if _http_ready(http_port):
            return "HTTP ready"
    raise TimeoutError("never ready")


def test_default_serve_runs_the_installed_package_and_is_ready_only_when_every_worker_is(
    default_model_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "imported.txt"
    project = _hostile_folder(tmp_path, marker)
    grpc_port, http_port, metrics_port = free_ports(3)
    mha = Path(sys.executable).parent / "mha"  # the console script, as a user runs it
    command = [str(mha), "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port)]
    command += ["--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"MHA_DEFAULT_MODEL_DIR": str(default_model_dir), "MHA_LOG_FORMAT": "json"}
    log_path = tmp_path / "server.log"
    proc = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    workers = available_cpus()  # --workers auto, the default
    config, weights = load_checkpoint(default_model_dir / "weights.safetensors")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            signal_name = _first_ready(pb_grpc.GRPCInferenceServiceStub(channel), http_port, proc)
        url = f"127.0.0.1:{grpc_port}"
        x = np.random.default_rng(1).standard_normal((1, 4, 128), dtype=np.float32)
        refused: list[str] = []
        answers = []

        def start(sequence: int) -> None:
            try:
                with MHAClient(url, own_connection=True) as own:  # the kernel gives it to any worker
                    answers.append((sequence, own.step(sequence, x, offset=0, start=True).worker))
            except InferenceError as exc:
                refused.append(f"{sequence}: {exc.code.name} {exc}")

        threads = [threading.Thread(target=start, args=(i,)) for i in range(1, SEQUENCES + 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert refused == [], f"refused after {signal_name} said ready: {refused[:3]}"
        assert len({worker for _, worker in answers}) >= min(workers, 2)  # 48 connections reach more than one
        with MHAClient(url) as client:  # one connection: every other worker's sequences handed to it
            for sequence, worker in answers:
                assert client.step(sequence, x, offset=4).worker == worker
            y = client.infer(x)
        import torch

        assert relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config)) < 1e-5
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    log = log_path.read_text()
    assert not marker.exists(), f"the folder's packages were imported: {marker.read_text()}"
    assert code == 0, log[-2000:]
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    if workers > 1:
        assert sum("worker" in e["msg"] and "started" in e["msg"] for e in lines) >= workers, log[-2000:]
