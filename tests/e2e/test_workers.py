"""`mha serve --workers 2`: both workers serve one port, metrics add up, a dead worker is
replaced, SIGTERM drains them all."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.client.client import MHAClient
from tests.support import ServerProcess

STARTED = re.compile(r"worker (\d+) started \(pid (\d+), metrics 127\.0\.0\.1:(\d+)\)")


def _samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _ok(samples: dict, method: str = "ModelInfer") -> float:
    return samples.get(("mha_requests_total", (("code", "OK"), ("method", method))), 0.0)


def _until(predicate, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_two_workers_share_the_port_add_up_restart_and_drain(small_model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    try:
        started = {int(i): (int(pid), int(port)) for i, pid, port in STARTED.findall(server.log())}
        assert sorted(started) == [0, 1]
        x = np.ones((1, 3, 32), np.float32)
        for _ in range(40):  # a channel each: the kernel spreads connections over the workers
            with MHAClient(server.url) as client:
                client.infer(x)
        per_worker = [_ok(_samples(port)) for _, port in started.values()]
        total = _samples(server.metrics_port)
        assert all(n > 0 for n in per_worker) and sum(per_worker) == 40 == _ok(total)
        assert total[("mha_request_duration_seconds_count", (("method", "ModelInfer"),))] == 40  # histograms add up
        assert {total[("mha_ready", (("worker", str(i)),))] for i in range(2)} == {1.0}  # gauges by worker

        os.kill(started[0][0], signal.SIGKILL)
        restarted = lambda: _samples(server.metrics_port).get(("mha_worker_restarts_total", (("worker", "0"),)))  # noqa: E731
        _until(lambda: restarted() == 1.0)
        _until(lambda: _samples(server.metrics_port).get(("mha_ready", (("worker", "0"),))) == 1.0)
        assert "worker 0 (pid" in server.log() and "died with exit code -9; restarting it" in server.log()
        for _ in range(10):
            with MHAClient(server.url) as client:
                assert client.infer(x).shape == x.shape

        pids = [int(pid) for _, pid, _ in STARTED.findall(server.log())]
        assert server.terminate(timeout=60) == 0
        for pid in pids:  # every worker is gone (or a zombie waiting for its reaper)
            status = Path(f"/proc/{pid}/status")
            assert not status.exists() or "zombie" in status.read_text().lower()
    finally:
        server.kill()
