"""What ModelStatistics reports, Triton's way: counts and cumulative nanoseconds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.batch_engine import Timing
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
class Phases:
    """compute_input, compute_infer and compute_output: Triton counts each once per request (per
    execution in a batch size's entry), so the three counts are always equal."""

    input: Duration = field(default_factory=Duration)
    infer: Duration = field(default_factory=Duration)
    output: Duration = field(default_factory=Duration)

    def add(self, input_s: float, infer_s: float, output_s: float) -> None:
        self.input.add(input_s)
        self.infer.add(infer_s)
        self.output.add(output_s)


@dataclass
class ModelStats:
    last_inference_ms: int = 0  # wall-clock milliseconds since the epoch
    inference_count: int = 0  # rows served
    execution_count: int = 0  # batches executed
    success: Duration = field(default_factory=Duration)  # whole requests, in the server
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)  # per request answered
    compute: Phases = field(default_factory=Phases)  # per request answered: its batch's
    batches: dict[int, Phases] = field(default_factory=dict)  # rows -> per execution

    def observe_batch(self, event: BatchEvent) -> None:
        if event.error is not None:
            return
        self.execution_count += 1
        self.batches.setdefault(event.rows, Phases()).add(event.input_s, event.infer_s, event.output_s)

    def observe_answers(self, rows: int, timings: Sequence[Timing], last_ms: int) -> None:
        """Answered requests, in bulk: the rows they held, each one's Timing (its wait, its batch's
        compute), and the wall clock (ms since the epoch) of the last one."""
        self.inference_count += rows
        self.queue.add_each([t.queue_s for t in timings])
        for timing in timings:
            self.compute.add(*timing.compute)
        self.last_inference_ms = max(self.last_inference_ms, last_ms)

    def observe_requests(self, succeeded: Sequence[float], failed: Sequence[float]) -> None:
        """Whole requests' times in the server, in bulk."""
        self.success.add_each(succeeded)
        self.fail.add_each(failed)
