"""Test helpers: real servers on loopback, in-process (a thread with its own loop) or as a process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry

from service.app.launch import ServerProcess, free_port, free_ports, wait_serving
from service.app.server import Running, drain_and_stop, load_and_serve, start
from service.batching import Clock
from service.engine.keeper import ComputeHook
from service.settings import Settings

__all__ = ["ROOT", "ManualClock", "ServerProcess", "ServerThread", "free_port", "free_ports", "make_settings"]
__all__ += ["server_process"]
__all__ += ["ComputeGate", "bench_module", "wait_serving"]

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def server_process(args: list[str], log_path: Path, **kwargs: Any) -> Iterator[ServerProcess]:
    """`mha serve ARGS` as a child process, SERVING when entered and killed on the way out."""
    server = ServerProcess(args, **kwargs)
    try:
        yield server.start(log_path)
    finally:
        server.kill()


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py, loaded as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses and pickling look it up there
    spec.loader.exec_module(module)
    return module


def http_json(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """GET `path` on 127.0.0.1:`port` (POST `body` as JSON when given): the status and the JSON
    answer, an error's included."""
    return http_raw(port, path, None if body is None else json.dumps(body).encode())


def http_raw(port: int, path: str, data: bytes | None = None) -> tuple[int, Any]:
    """GET `path` on 127.0.0.1:`port` (POST `data`, any bytes, when given): the status and the
    JSON answer, an error's included."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def until(predicate: Callable[[], bool], timeout_s: float = 30.0, every_s: float = 0.01, what: str = "") -> None:
    """Wait, polling every `every_s`, until `predicate()` holds; fail the test after `timeout_s`
    (what another process or thread does in its own time: a log line written, a count merged)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}" if what else "timed out"
        time.sleep(every_s)


def own_memory_bytes(pid: int) -> int:
    """The process's resident memory of its own (anonymous pages: what each worker, or the
    supervisor, adds to a pod's memory), as the kernel counts it."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["RssAnon"].split()[0]) * 1024


def make_settings(model_dir: Path, **overrides: Any) -> Settings:
    base = Settings(
        model_dir=model_dir,
        host="127.0.0.1",
        grpc_port=0,  # 0: the server picks a free port and reports it (ServerThread.url and the ports below)
        http_port=None,
        metrics_port=None,
        log_format="text",
        threads=2,
        grace_s=2.0,
        max_queue_delay_ms=2.0,
    )
    return replace(base, **overrides)


class ServerThread:
    """A real grpc.aio server on 127.0.0.1, running in a thread with its own event loop."""

    def __init__(
        self,
        settings: Settings,
        wait_ready: bool = True,
        clock: Clock | None = None,
        compute_hook: ComputeHook | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.compute_hook = compute_hook
        self._registry = CollectorRegistry()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._wait_ready = wait_ready
        self.running: Running | None = None

    def call(self, coro: Any, timeout: float = 120) -> Any:
        return self.submit(coro).result(timeout)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run `coro` on the server's loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.running = self.call(start(self.settings, self._registry, self.clock, self.compute_hook))
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
    def http_port(self) -> int:
        assert self.running is not None and self.running.http_port, "make_settings(..., http_port=0) opens it"
        return self.running.http_port

    @property
    def metrics_port(self) -> int:
        assert self.running is not None and self.running.metrics_port, "make_settings(..., metrics_port=0)"
        return self.running.metrics_port

    @property
    def health_port(self) -> int:
        assert self.running is not None and self.running.health_port, "make_settings(..., health_port=0)"
        return self.running.health_port

    @property
    def engine(self):
        assert self.running is not None
        self.settle()
        return self.running.engine

    @property
    def registry(self) -> CollectorRegistry:
        self.settle()
        return self._registry

    def settle(self) -> None:
        """Let the server's loop run what it has scheduled so far: the bookkeeping of an answer the
        test has received runs after the answer is sent (service/deferred.py), and a test that
        reads the metrics or statistics in-process reads them after it."""

        async def one_turn() -> None:
            await asyncio.sleep(0)

        if self._thread.is_alive() and threading.current_thread() is not self._thread and self._loop.is_running():
            self.call(one_turn(), timeout=30)

    def __exit__(self, *exc: object) -> None:
        if self.running is not None:
            self.call(drain_and_stop(self.running, 1.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class ManualClock:
    """The batcher's clock, moved only by the test: `advance` wakes waits whose time has come."""

    def __init__(self, start: float = 100.0) -> None:
        self.t = start
        self._timers: list[tuple[float, asyncio.Event]] = []

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, until: float) -> None:
        if until <= self.t or event.is_set():
            return
        timer = asyncio.Event()
        self._timers.append((until, timer))
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(timer.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self._timers.remove((until, timer))

    @property
    def waiting(self) -> int:
        """Waits that only the clock can end now."""
        return len(self._timers)

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for until, timer in self._timers:
            if until <= self.t:
                timer.set()

    async def advance_and_settle(self, seconds: float) -> None:
        """`advance`, on the server's loop, then the waits it woke take their turns."""
        self.advance(seconds)
        for _ in range(10):
            await asyncio.sleep(0)


class ComputeGate:
    """A compute_hook (ServerThread(..., compute_hook=gate)): each compute of the `held` kinds
    ("batch", "steps") waits on the computing thread for a permit, so the test, not the machine's
    speed, decides what is computing when; `hold_next(ready)` holds the next compute until
    `ready()` (requests gather behind it, as on a busy server); `poison` marks inputs whose
    compute raises, as a failing backend would."""

    def __init__(self, held: tuple[str, ...] = ("batch", "steps"), poison: float | None = None) -> None:
        self.held, self.poison = held, poison
        self.permits = threading.Semaphore(0)
        self.waiting = threading.Semaphore(0)  # released once per compute that reached the gate
        self.computed: list[tuple[str, int]] = []  # (kind, rows) of each compute let through
        self.holding = 0  # tensors (a batch's one, or a step each) of the compute held by hold_next, for its `ready`
        self.widest = 0  # the most tensors one compute took: 2 or more steps, sequences that shared a batch
        self._ready: Callable[[], bool] | None = None

    def hold_next(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    def __call__(self, kind: str, inputs: Any) -> None:
        if kind in self.held:
            self.waiting.release()
            assert self.permits.acquire(timeout=60), "the test never let this compute run"
        if (ready := self._ready) is not None:
            self._ready, self.holding = None, len(inputs)
            deadline = time.monotonic() + 30
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.001)
        self.computed.append((kind, sum(int(x.shape[0]) for x in inputs)))
        self.widest = max(self.widest, len(inputs))
        if self.poison is not None and any((x == self.poison).any() for x in inputs):
            raise RuntimeError("injected fault: a poisoned input reached the backend")

    def arrived(self, timeout_s: float = 60.0) -> None:
        """Wait until one more compute is held at the gate."""
        assert self.waiting.acquire(timeout=timeout_s), "no compute reached the gate"
