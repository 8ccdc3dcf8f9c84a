"""What ModelStatistics reports, Triton's way: counts and cumulative nanoseconds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from service.batching import BatchEvent


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class ModelStats:
    last_inference_ms: int = 0  # wall-clock milliseconds since the epoch
    inference_count: int = 0  # rows served
    execution_count: int = 0  # batches executed
    success: Duration = field(default_factory=Duration)  # whole requests, in the server
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=dict)  # rows -> compute

    def observe_batch(self, event: BatchEvent) -> None:
        if event.error is not None:
            return
        self.execution_count += 1
        self.compute_infer.add(event.compute_s)
        self.batches.setdefault(event.rows, Duration()).add(event.compute_s)

    def observe_answer(self, rows: int, queue_s: float) -> None:
        self.inference_count += rows
        self.queue.add(queue_s)
        self.last_inference_ms = int(time.time() * 1e3)

    def observe_request(self, ok: bool, seconds: float) -> None:
        (self.success if ok else self.fail).add(seconds)
