"""Up to which size a CPU backend computes a batch on one thread rather than its pool.

Waking a pool costs more than it saves on a few tokens, and the crossover depends on the model
and the machine: each CPU backend measures it at start with its own two ways of running (ORT: a
second, single-threaded session; PyTorch: its pool narrowed to one thread for the call).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

CROSSOVER_T = (1, 4, 16, 64, 256)  # (1, T, C) measured, lightest first
POOL_MARGIN = 1.25  # the pool must be this much faster to be chosen over one thread
ROUNDS = 15

Run = Callable[[np.ndarray], object]  # (B, T, C) -> anything; only its time counts


def single_thread_limit(medians: dict[int, tuple[float, float]], margin: float = POOL_MARGIN) -> int:
    """The largest T whose (one thread, pool) median times keep one thread, and every smaller T
    too; 0 when the pool wins from the start. One thread is kept unless the pool is faster by
    `margin`: at about equal time one thread costs one core, where the pool wakes them all
    (and the measurement at start-up is noisy: without a margin the limit varied 0 to 256 from
    one start to the next on the same machine, and a lone (1, 64, 128) paid the pool's wake-up)."""
    best = 0
    for T in sorted(medians):
        one, many = medians[T]
        if one > margin * many:
            break
        best = T
    return best


def measure_crossover(one: Run, pool: Run, width: int) -> int:
    """`single_thread_limit` of (1, T, width) for T in CROSSOVER_T, from interleaved medians of
    ROUNDS runs each after warm-up (first runs allocate); stops at the first T the pool wins."""
    medians: dict[int, tuple[float, float]] = {}
    for T in CROSSOVER_T:
        x = np.random.default_rng(T).standard_normal((1, T, width), dtype=np.float32)  # (1, T, C)
        for run in (one, pool):
            for _ in range(3):
                run(x)
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(ROUNDS):
            for run, samples in zip((one, pool), times, strict=True):
                start = time.perf_counter()
                run(x)
                samples.append(time.perf_counter() - start)
        medians[T] = (float(np.median(times[0])), float(np.median(times[1])))
        if medians[T][0] > POOL_MARGIN * medians[T][1]:
            break
    return single_thread_limit(medians)
