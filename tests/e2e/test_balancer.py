"""Three `mha serve` replicas behind a real L7 balancer: nginx from Debian's package, configured
by deploy/nginx/mha-serve.conf as ingress-nginx configures it. Stateless requests of one channel
spread over every replica; sequences stay on one replica, each step on a new channel; a replica
killed with SIGKILL costs its sequences one restart and nobody a wrong answer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.app.launch import ServerProcess
from service.client.client import ClientSequence, InferenceError, MHAClient
from service.client.loadgen import requests_answered
from tests.support import ROOT, bench_module, until

common = bench_module("common")  # nginx in front of servers, as bench/compare.py runs it
Balancer = common.Balancer
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
C = 32


@pytest.fixture(scope="module")
def replicas(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("replicas")
    servers = [
        ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--replica-name", f"r{i}"])
        for i in range(3)
    ]
    starting = [threading.Thread(target=s.start, args=(logs / f"r{i}.log",)) for i, s in enumerate(servers)]
    try:
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join(180)
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def balancer(replicas: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balancer]:
    assert common.NGINX.exists(), "make install unpacks nginx from Debian's package into .tools/nginx"
    nginx = Balancer(common.NGINX, tmp_path_factory.mktemp("nginx"), replicas).start()
    try:
        yield nginx
    finally:
        nginx.stop()


def _infer_count(server: ServerProcess) -> float:
    return requests_answered(f"127.0.0.1:{server.metrics_port}")


REQUESTS = 300  # hashed on random keys: a replica's share is 1/3 +- 0.027; at 60 it fell under 0.2 one run in 25


def test_one_tritonclient_channel_reaches_every_replica(replicas: list[ServerProcess], balancer: Balancer) -> None:
    before = [_infer_count(r) for r in replicas]
    run = subprocess.run(
        [str(TRITON_PYTHON), str(Path(__file__).with_name("triton_spread.py")), balancer.url, str(REQUESTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    shares = [(_infer_count(r) - b) / REQUESTS for r, b in zip(replicas, before, strict=True)]
    assert sum(shares) == pytest.approx(1.0)
    assert min(shares) >= 0.2, shares  # kube-proxy (L4) would give one replica all of them


class Driven:
    """A sequence driven through the balancer, each step on a new channel, checked step by step."""

    def __init__(self, url: str, sequence_id: str, weights: dict, config: object, seed: int, entry: str) -> None:
        self.url, self.weights, self.config, self.entry = url, weights, config, entry
        self.sequence = ClientSequence(MHAClient(url, model=entry), sequence_id)
        self.whole = np.zeros((1, 0, C), np.float32)
        self.rng = np.random.default_rng(seed)
        self.errors: list[float] = []
        self.replicas: set[str] = set()

    def step(self, t: int) -> None:
        x = self.rng.standard_normal((1, t, C), dtype=np.float32)
        self.whole = np.concatenate([self.whole, x], axis=1)  # (1, P + t, C)
        self.sequence.client.close()
        self.sequence.client = MHAClient(self.url, model=self.entry)  # a new channel: a new connection to the balancer
        y = self.sequence.send(x)
        reference = attention_view(torch.from_numpy(self.whole), self.weights, self.config)[:, -t:]
        self.errors.append(relative_error(torch.from_numpy(y.copy()), reference))
        self.replicas.add(self.sequence.replica)

    def close(self) -> None:
        self.sequence.client.close()


def _sequences(balancer: Balancer, model_dir: Path, prefix: str) -> list[Driven]:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    entries = ("mha_sequence", "mha")  # the sequence entry, and the stateless one that takes steps too
    return [Driven(balancer.url, f"{prefix}-{i}", weights, config, i, entries[i % 2]) for i in range(8)]


def test_a_call_through_nginx_is_logged_under_nginxs_request_id(
    replicas: list[ServerProcess], balancer: Balancer
) -> None:
    """deploy/nginx/mha-serve.conf passes nginx's $request_id on as X-Request-ID: the replica
    that answers logs the call under it (32 hex digits, where a replica makes 16 of its own), so
    nginx's access log and the server's log join on one id. A refused request is logged at INFO."""
    with MHAClient(balancer.url) as client, pytest.raises(InferenceError):
        client.infer(np.zeros((1, 2, C - 1), np.float32))

    def refused_lines() -> list[dict]:
        lines = [json.loads(line) for r in replicas for line in r.log().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("code") == "INVALID_ARGUMENT"]

    until(lambda: bool(refused_lines()), timeout_s=10, every_s=0.05, what="the replica logs the refused call")
    (line,) = refused_lines()
    assert re.fullmatch(r"[0-9a-f]{32}", line["request_id"]), line


def test_eight_concurrent_sequences_stay_exact_with_a_new_channel_per_step(
    balancer: Balancer, small_model_dir: Path
) -> None:
    sequences = _sequences(balancer, small_model_dir, "steady")

    def drive(driven: Driven) -> None:
        for t in [8] + [1] * 16:
            driven.step(t)

    threads = [threading.Thread(target=drive, args=(d,)) for d in sequences]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for driven in sequences:
        driven.close()
        assert len(driven.errors) == 17 and max(driven.errors) < 1e-5, driven.sequence.id
        assert driven.sequence.restarts == 0 and len(driven.replicas) == 1  # one replica held it throughout
    assert len({d.sequence.replica for d in sequences}) >= 2  # and the sequences spread over replicas


def test_a_killed_replica_costs_its_sequences_one_restart_and_nobody_a_wrong_answer(
    replicas: list[ServerProcess], balancer: Balancer, small_model_dir: Path
) -> None:
    sequences = _sequences(balancer, small_model_dir, "killed")
    for t in [8] + [1] * 5:
        for driven in sequences:
            driven.step(t)
    victim_name = sequences[0].sequence.replica
    victim = replicas[int(victim_name[1:])]
    on_victim = [d for d in sequences if d.sequence.replica == victim_name]
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    for _ in range(8):
        for driven in sequences:
            driven.step(1)
    for driven in sequences:
        driven.close()
        assert max(driven.errors) < 1e-5, driven.sequence.id
        expected = 1 if driven in on_victim else 0
        assert driven.sequence.restarts == expected, (driven.sequence.id, driven.replicas)
        assert driven.sequence.replica != victim_name
