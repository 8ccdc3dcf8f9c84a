"""A closed-loop load generator for `mha bench` and bench/: N clients, each one request at a time."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.client.client import InferenceError, MHAClient

# The client's own mistakes: every further request would fail the same way, so the run stops.
STOP_ON = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
}


CONNECTIONS = ("one-channel", "per-client")  # every client on one shared channel, or a connection each


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    requests: int
    errors: dict[str, int]  # status code name -> count
    seconds: float
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float  # the slowest request: a pause of the whole server shows here first
    stopped: str = ""  # why the run stopped early: the server's own message
    server_cpu_ms_per_request: float | None = None  # from the server's process_cpu_seconds_total
    connections: str = "per-client"  # one of CONNECTIONS

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] * 1e3


VARIANTS = 4  # distinct inputs per sequence length, so that no two requests in a row need be alike


def input_pool(seq_lens: Sequence[int], batch: int, d_model: int, seed: int = 0) -> dict[int, list[np.ndarray]]:
    """The inputs of a run, drawn before its clock starts and shared by its clients: VARIANTS
    (batch, T, d_model) float32 arrays for each T. Drawing them per request cost the generator
    0.13 ms of CPU per (1, 64, 128) request (4 ms per (4, 512, 128)), on the CPUs the server
    under test needs too (docs/benchmarks.md); the values do not change the server's work."""
    rng = np.random.default_rng(seed)
    return {
        T: [rng.standard_normal((batch, T, d_model), dtype=np.float32) for _ in range(VARIANTS)]
        for T in dict.fromkeys(int(t) for t in seq_lens)
    }


def shape_pool(shapes: Sequence[tuple[int, int, int]], seed: int = 0) -> list[np.ndarray]:
    """VARIANTS float32 inputs of each (B, T, C) shape, drawn before a run's clock starts."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for shape in shapes for _ in range(VARIANTS)]


def run_load(
    url: str,
    concurrency: int,
    seconds: float,
    seq_lens: Sequence[int],
    batch: int = 1,
    d_model: int = 128,
    progress: Callable[[float, int], None] | None = None,
    shapes: Sequence[tuple[int, int, int]] = (),
    **client_kwargs: object,
) -> LoadResult:
    """Each of `concurrency` clients sends (batch, T, d_model) requests, T drawn from seq_lens
    (or, when `shapes` are given, requests of those (B, T, C) shapes, each as often);
    `progress(elapsed_s, requests)` is called about 4 times a second while they run.

    Each client has a connection of its own, as separate client processes would (gRPC would
    otherwise multiplex every channel of this process to one target over one connection, and a
    server of several processes sharing its port by SO_REUSEPORT would see one client);
    `own_connection=False` shares one."""
    client_kwargs.setdefault("own_connection", True)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    stopped: list[str] = []
    lock = threading.Lock()
    if shapes:
        choices = shape_pool(shapes)
    else:
        pool = input_pool(seq_lens, batch, d_model)
        choices = [x for T in seq_lens for x in pool[int(T)]]  # T as often as seq_lens names it
    stop_at = time.monotonic() + seconds

    def worker(i: int) -> None:
        draw = random.Random(i)  # which input next: far cheaper than numpy's generator for one pick
        with MHAClient(url, **client_kwargs) as client:  # type: ignore[arg-type]
            while time.monotonic() < stop_at and not stopped:
                x = draw.choice(choices)
                start = time.perf_counter()
                try:
                    client.infer(x, timeout=30)
                except InferenceError as exc:
                    with lock:
                        errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                        if exc.code in STOP_ON and not stopped:
                            stopped.append(str(exc))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(0.25)
        if progress is not None:
            progress(time.monotonic() - started, len(latencies))
    elapsed = time.monotonic() - started
    latencies.sort()
    return LoadResult(
        concurrency=concurrency,
        requests=len(latencies),
        errors=errors,
        seconds=elapsed,
        throughput_rps=len(latencies) / elapsed,
        p50_ms=_percentile(latencies, 0.5),
        p90_ms=_percentile(latencies, 0.9),
        p95_ms=_percentile(latencies, 0.95),
        p99_ms=_percentile(latencies, 0.99),
        max_ms=_percentile(latencies, 1.0),
        stopped=stopped[0] if stopped else "",
        connections="per-client" if client_kwargs["own_connection"] else "one-channel",
    )


def server_cpu_seconds(metrics_url: str) -> float | None:
    """The server's process_cpu_seconds_total, or None when its metrics cannot be read."""
    try:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "process_cpu_seconds":
            return float(sum(s.value for s in family.samples))
    return None


def requests_answered(metrics_url: str, method: str = "ModelInfer", code: str = "OK") -> float:
    """How many `method` calls the server at `metrics_url` (host:port) answered with `code`,
    from its mha_requests_total."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(
            s.value
            for f in families
            for s in f.samples
            if s.name == "mha_requests_total" and s.labels == {"method": method, "code": code}
        )
