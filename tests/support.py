"""Test helpers: real servers on loopback, in-process (a thread with its own loop) or as a process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from service.server import Running, drain_and_stop, load_and_serve, start
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_settings(model_dir: Path, **overrides: Any) -> Settings:
    base = Settings(
        model_dir=model_dir,
        host="127.0.0.1",
        grpc_port=0,
        metrics_port=0,
        log_format="text",
        threads=2,
        grace_s=2.0,
        max_queue_delay_ms=2.0,
    )
    return replace(base, **overrides)


class ServerThread:
    """A real grpc.aio server on 127.0.0.1, running in a thread with its own event loop."""

    def __init__(self, settings: Settings, wait_ready: bool = True) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._wait_ready = wait_ready
        self.running: Running | None = None

    def call(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.running = self.call(start(self.settings, self.registry))
        if self._wait_ready:
            self.call(load_and_serve(self.running))
        return self

    def load(self) -> None:
        assert self.running is not None
        self.call(load_and_serve(self.running))

    @property
    def url(self) -> str:
        assert self.running is not None
        return f"127.0.0.1:{self.running.grpc_port}"

    @property
    def core(self):
        assert self.running is not None
        return self.running.core

    def __exit__(self, *exc: object) -> None:
        if self.running is not None:
            self.call(drain_and_stop(self.running, 1.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class ServerProcess:
    """`mha serve` as a child process, for signals and for clients that need their own process."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.args = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--log-format",
            "json",
            *args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = str(ROOT)
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log_path: Path, ready_timeout: float = 120) -> ServerProcess:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            self.args,
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.DEVNULL,
            stderr=log_path.open("w"),
            text=True,
        )
        wait_serving(self.url, ready_timeout, self.proc)
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_serving(url: str, timeout: float, proc: subprocess.Popen[str] | None = None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            with contextlib.suppress(grpc.RpcError):
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"{url} not SERVING after {timeout} s")


@contextlib.contextmanager
def server_process(args: list[str], log_path: Path, **kwargs: Any) -> Iterator[ServerProcess]:
    server = ServerProcess(args, **kwargs)
    try:
        yield server.start(log_path)
    finally:
        server.kill()
