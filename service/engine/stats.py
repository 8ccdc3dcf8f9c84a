"""What ModelStatistics reports, Triton's way: counts and cumulative nanoseconds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.batching import BatchEvent


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def add_each(self, seconds: Sequence[float]) -> None:
        """Many durations, each counted once (as add() would count them one by one)."""
        self.count += len(seconds)
        self.ns += sum(int(s * 1e9) for s in seconds)


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

    def observe_answers(self, rows: int, queue_s: Sequence[float], last_ms: int) -> None:
        """Answered requests, in bulk: the rows they held, the time each queued, and the wall
        clock (ms since the epoch) of the last one."""
        self.inference_count += rows
        self.queue.add_each(queue_s)
        self.last_inference_ms = max(self.last_inference_ms, last_ms)

    def observe_requests(self, succeeded: Sequence[float], failed: Sequence[float]) -> None:
        """Whole requests' times in the server, in bulk."""
        self.success.add_each(succeeded)
        self.fail.add_each(failed)
