"""A closed-loop load generator for `mha bench` and bench/: N clients, each one request at a time."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from service.client import InferenceError, MHAClient


@dataclass(frozen=True)
class LoadResult:
    requests: int
    errors: dict[str, int]  # status code name -> count
    seconds: float
    throughput_rps: float
    p50_ms: float
    p99_ms: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def run_load(
    url: str,
    concurrency: int,
    seconds: float,
    seq_lens: Sequence[int],
    batch: int = 1,
    d_model: int = 128,
    **client_kwargs: object,
) -> LoadResult:
    """Each of `concurrency` clients sends (batch, T, d_model) requests, T drawn from seq_lens."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def worker(i: int) -> None:
        rng = np.random.default_rng(i)
        with MHAClient(url, **client_kwargs) as client:  # type: ignore[arg-type]
            while time.monotonic() < stop_at:
                x = rng.standard_normal((batch, int(rng.choice(seq_lens)), d_model), dtype=np.float32)
                start = time.perf_counter()
                try:
                    client.infer(x, timeout=30)
                except InferenceError as exc:
                    with lock:
                        errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    latencies.sort()
    n = len(latencies)
    return LoadResult(
        requests=n,
        errors=errors,
        seconds=elapsed,
        throughput_rps=n / elapsed,
        p50_ms=statistics.median(latencies) * 1e3 if n else float("nan"),
        p99_ms=latencies[min(n - 1, int(0.99 * n))] * 1e3 if n else float("nan"),
    )
