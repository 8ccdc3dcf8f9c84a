"""A newcomer's first `mha serve`, outside a checkout: it binds at once (health NOT_SERVING while
the default model is exported), keeps the model in the user's cache (or where --default-model-dir
says), and says where."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import ROOT, ServerProcess


def _messages(log: str) -> list[str]:
    return [json.loads(line)["msg"] for line in log.splitlines() if line.startswith("{")]


def _health_while_exporting(server: ServerProcess, seen: list[int]) -> threading.Thread:
    """Health asked as soon as the port is bound, while the export runs; its answer into `seen`."""

    def ask() -> None:
        with grpc.insecure_channel(server.url) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            seen.append(check(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=60).status)

    asker = threading.Thread(target=ask)
    asker.start()
    return asker


def test_serve_outside_a_checkout_binds_first_then_exports_into_the_users_cache(tmp_path: Path) -> None:
    elsewhere, cache = tmp_path / "elsewhere", tmp_path / "cache"
    elsewhere.mkdir()
    env = {"XDG_CACHE_HOME": str(cache), "MHA_LOG_LEVEL": "DEBUG"}  # "listening" is a DEBUG line
    server = ServerProcess(["--backend", "torch"], env=env, cwd=elsewhere)
    seen: list[int] = []
    asker = _health_while_exporting(server, seen)
    try:
        server.start(tmp_path / "server.log", ready_timeout=300)
        asker.join(60)
        messages = _messages(server.log())
        foreign = [line for line in server.log().splitlines() if line.strip() and not line.startswith("{")]
    finally:
        server.kill()
    assert foreign == []  # every line a JSON record: before, torch's exporter wrote its own at every export
    home = cache / "mha-serve" / "models" / "default"
    listening = next(i for i, m in enumerate(messages) if m.startswith("listening"))
    exporting = next(i for i, m in enumerate(messages) if m.startswith(f"no default model in {home}: exporting"))
    assert listening < exporting, messages  # before: exported (~10 s) into ./models/default, then bound
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]
    assert (home / "manifest.json").is_file() and list(elsewhere.iterdir()) == []
    assert any(m == f"serving {home} with torch-cpu on cpu" for m in messages), messages
    assert sum("self-check relative error" in m for m in messages) == 1, messages  # the verdict, once
    ready = next(m for m in messages if m.startswith("ready:"))
    mha = "mha" if shutil.which("mha") == str(ROOT / ".venv" / "bin" / "mha") else ROOT / ".venv" / "bin" / "mha"
    assert f"try `{mha} infer --url 127.0.0.1:" in ready  # the venv's mha (started as python -m service.cli)


def test_with_workers_the_first_binds_at_once_and_every_worker_serves(tmp_path: Path) -> None:
    """The default worker count's way (`make serve` on 2 CPUs): the first worker binds the ports
    at once and answers NOT_SERVING while it exports the default model (here where
    --default-model-dir says); the others start with it and load once it has, and the replica is ready only
    then: connections reach both, and the model it exported answers exactly."""
    import numpy as np
    import torch

    from model.checkpoint import load_checkpoint
    from model.reference import attention_view, relative_error
    from service.client.client import MHAClient

    elsewhere, home = tmp_path / "elsewhere", tmp_path / "models" / "default"
    elsewhere.mkdir()
    args = ["--backend", "torch", "--workers", "2", "--default-model-dir", str(home)]
    server = ServerProcess(args, env={"MHA_LOG_LEVEL": "DEBUG"}, cwd=elsewhere)
    seen: list[int] = []
    asker = _health_while_exporting(server, seen)
    try:
        server.start(tmp_path / "server.log", ready_timeout=300)
        asker.join(60)
        x = np.ones((1, 2, 128), np.float32)
        workers = set()
        for i in range(1, 33):  # each on a connection of its own, which the kernel gives to either worker
            with MHAClient(server.url, own_connection=True) as client:
                workers.add(client.step(i, x, offset=0, start=True).worker)
        with MHAClient(server.url) as client:
            x = np.random.default_rng(0).standard_normal((2, 9, 128), dtype=np.float32)
            y = client.infer(x)
        messages = _messages(server.log())
    finally:
        server.kill()
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING], messages[-20:]
    assert workers == {0, 1}
    assert (home / "manifest.json").is_file() and list(elsewhere.iterdir()) == []
    config, weights = load_checkpoint(home / "weights.safetensors")
    assert relative_error(torch.from_numpy(y.copy()), attention_view(torch.from_numpy(x), weights, config)) < 1e-5
    exporting = [i for i, m in enumerate(messages) if m.startswith(f"no default model in {home}: exporting")]
    assert len(exporting) == 1, messages  # one export, by the first worker
    listening = next(i for i, m in enumerate(messages) if m.startswith("listening"))
    assert listening < exporting[0], messages  # before: exported first, and only then bound
