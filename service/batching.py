"""Batching primitives of the batch engine (service/batch_engine.py), for both of its uses.

No gRPC, no ONNX, no torch: numpy and asyncio only.
- deciding, pure (no event loop, no clock): `plan_batch` (stateless requests) and `plan_steps`
  (decode steps) say which queued requests form the next batch and which are dead; `form_at`
  says until when the oldest request may wait for company;
- moving arrays, pure: `merge` right-pads requests of different T into one batch and `split`
  slices the outputs back. Padding is exact for causal attention (position t only attends to
  positions <= t); non-causal models merge only equal T;
- time: the injected `Clock`, and `BatchEvent`, what one executed batch reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 8  # rows (sum of B) per executed batch; 1 turns batching off
    max_queue_delay_s: float = 0.002  # how long the first request waits for company
    max_queue_size: int = 256  # requests waiting (not rows); beyond it: RESOURCE_EXHAUSTED
    max_padding_ratio: float = 0.25  # padded tokens / batch tokens allowed when merging T
    causal: bool = True  # merging different T is exact only for causal attention
    max_cells: int | None = None  # rows x T_max x T_max a merged batch may reach (its attention memory)


# Deciding ----------------------------------------------------------------------------------


def batch_mflop(rows: int, seq: int, width: int) -> float:
    """Work of one forward pass over (rows, seq, width): four projections and the two
    attention products, in millions of floating-point operations."""
    return (8 * rows * seq * width * width + 4 * rows * seq * seq * width) / 1e6


P = TypeVar("P")  # what a waiting request carries
R = TypeVar("R")  # what its caller awaits


@dataclass(eq=False)
class Pending(Generic[P, R]):
    """A request waiting in the batch engine: what it carries and the future its caller awaits."""

    payload: P
    shape: tuple[int, ...]  # (B, T, C) of its tensor
    future: asyncio.Future[R]
    enqueued: float = 0.0  # clock time
    deadline: float | None = None  # clock time
    trace: Any = None  # the span of the call that waits, when it is traced
    level: int = 1  # its priority level (1 the highest)
    arrival: int = 0  # its place in arrival order
    timeout_at: float | None = None  # clock time its queue policy's timeout passes
    delays: bool = False  # its policy DELAYs it then (else REJECTs it)
    delayed: bool = False  # its timeout passed under DELAY: it goes behind its level
    overtaken: int = 0  # batches formed ahead of it that held a request that came after it

    @property
    def rows(self) -> int:
        return int(self.shape[0])

    @property
    def seq(self) -> int:
        return int(self.shape[1])

    @property
    def gone(self) -> bool:
        """Answered already, or nobody waits for it any more (cancelled)."""
        return self.future.done()


class Queued(Protocol):
    """What the planner needs to know of a queued request."""

    @property
    def rows(self) -> int: ...  # B
    @property
    def seq(self) -> int: ...  # T
    @property
    def enqueued(self) -> float: ...  # clock time
    @property
    def deadline(self) -> float | None: ...  # clock time
    @property
    def gone(self) -> bool: ...  # the caller stopped waiting (cancelled)


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True)
class Plan(Generic[Q]):
    batch: list[Q]  # the oldest live request and, in FIFO order, those that fit with it
    rest: list[Q]  # stay queued, in order
    expired: list[Q] = field(default_factory=list)  # deadline passed: answer DEADLINE_EXCEEDED
    gone: list[Q] = field(default_factory=list)  # nobody waits for them: drop


def _sorted(queue: Sequence[Q], now: float) -> tuple[list[Q], list[Q], list[Q]]:
    """(live, expired, gone) of a queue, each in FIFO order."""
    gone, expired, live = list[Q](), list[Q](), list[Q]()
    for q in queue:
        if q.gone:
            gone.append(q)
        elif q.deadline is not None and q.deadline <= now:
            expired.append(q)
        else:
            live.append(q)
    return live, expired, gone


def plan_steps(queue: Sequence[Q], max_rows: int, now: float) -> Plan[Q]:
    """Decode steps: the oldest live ones, in FIFO order, up to `max_rows` rows (always at least
    one); their sequences' past lengths may differ, so no padding rule applies."""
    live, expired, gone = _sorted(queue, now)
    batch, rows = list[Q](), 0
    for item in live:
        if batch and rows + item.rows > max_rows:
            break
        batch.append(item)
        rows += item.rows
    return Plan(batch=batch, rest=live[len(batch) :], expired=expired, gone=gone)


def plan_batch(queue: Sequence[Q], config: BatcherConfig, now: float) -> Plan[Q]:
    """Which requests form the next batch; dead ones are set apart and never computed. One pass
    over the queue: the batch's rows, longest T and tokens are kept as requests join it."""
    live, expired, gone = _sorted(queue, now)
    if not live:
        return Plan(batch=[], rest=[], expired=expired, gone=gone)
    first = live[0]
    batch, rest = [first], list[Q]()
    size = (first.rows, first.seq, first.rows * first.seq)  # (rows, longest T, tokens) of the batch
    for item in live[1:]:
        grown = _grown(size, item.rows, item.seq, config)
        if grown is None:
            rest.append(item)
        else:
            batch.append(item)
            size = grown
    return Plan(batch=batch, rest=rest, expired=expired, gone=gone)


def _grown(size: tuple[int, int, int], b: int, t: int, config: BatcherConfig) -> tuple[int, int, int] | None:
    """The batch's (rows, longest T, tokens) with a (b, t) request in it; None when it does not fit."""
    rows, longest, tokens = size[0] + b, max(size[1], t), size[2] + b * t
    if rows > config.max_batch_size:
        return None
    if config.max_cells is not None and rows * longest**2 > config.max_cells:
        return None
    if not config.causal:  # no padding: only equal T merge
        return (rows, longest, tokens) if t == size[1] else None
    padded = rows * longest
    return (rows, longest, tokens) if (padded - tokens) / padded <= config.max_padding_ratio else None


def form_at(queue: Sequence[Queued], config: BatcherConfig, more_may_come: bool) -> float:
    """Clock time at which to form the next batch from a non-empty queue.

    At once (-inf) when batching is off, the queue already holds a full batch, or no other
    request is in the server (waiting would only add latency for a lone client); otherwise
    when the oldest request has waited max_queue_delay.
    """
    if config.max_batch_size <= 1 or config.max_queue_delay_s <= 0 or not more_may_come:
        return -float("inf")
    if sum(q.rows for q in queue) >= config.max_batch_size:
        return -float("inf")
    return queue[0].enqueued + config.max_queue_delay_s


# Moving arrays -------------------------------------------------------------------------------


def merge(xs: Sequence[np.ndarray]) -> np.ndarray:
    """Right-pad each (B_i, T_i, C) with zeros to the longest T and stack: (sum B_i, T_max, C)."""
    if len(xs) == 1:
        return xs[0]
    t_max = max(x.shape[1] for x in xs)
    out = np.zeros((sum(x.shape[0] for x in xs), t_max, xs[0].shape[2]), dtype=xs[0].dtype)  # (sum B, T_max, C)
    offset = 0
    for x in xs:
        out[offset : offset + x.shape[0], : x.shape[1]] = x
        offset += x.shape[0]
    return out


def split(y: np.ndarray, shapes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """(sum B_i, T_max, C) -> one (B_i, T_i, C) view per (B_i, T_i), in order."""
    out, offset = [], 0
    for rows, seq in shapes:
        out.append(y[offset : offset + rows, :seq])  # (B_i, T_i, C)
        offset += rows
    return out


# Time and reports --------------------------------------------------------------------------


class Clock(Protocol):
    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, until: float) -> None:
        """Return once `event` is set or the clock reaches `until`, whichever comes first."""


class MonotonicClock:
    """time.monotonic(), the clock gRPC deadlines are converted to."""

    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, until: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, until - self.now()))


@dataclass(slots=True)
class BatchEvent:
    """One executed batch, for metrics and statistics. Built once per batch and never changed."""

    requests: int
    rows: int
    seqs: tuple[int, ...]  # T of each request, in batch order
    padded_tokens: int
    formation_s: float  # the batcher began forming it -> it began computing
    compute_s: float  # the whole compute: its input, its inference and its output
    backend: str  # "" when it failed
    error: BaseException | None = None
    ended: float = 0.0  # clock time the compute ended (the event's `now`)
    traced: tuple[tuple[Any, float], ...] = ()  # (span, enqueued) of each traced request: tracing's
    input_s: float = 0.0  # of compute_s: the batch's input made (merged, padded)
    output_s: float = 0.0  # of compute_s: its outputs sliced back per request

    @property
    def infer_s(self) -> float:
        return max(0.0, self.compute_s - self.input_s - self.output_s)


def traced(batch: Sequence[Pending[Any, Any]]) -> tuple[tuple[Any, float], ...]:
    """(span, enqueued) of each traced request of a batch: what tracing needs of it."""
    return tuple((item.trace, item.enqueued) for item in batch if item.trace is not None)


def batch_event(
    shapes: Sequence[tuple[int, int]],  # (B, T) of each request, in batch order
    times: tuple[float, float],  # (formation began, compute began)
    now: float,
    backend: str,
    error: BaseException | None,
    traced: tuple[tuple[Any, float], ...] = (),
    phases: tuple[float, float] = (0.0, 0.0),  # (input_s, output_s) within the compute
) -> BatchEvent:
    """The report of a batch merged from `shapes` (right-padded to the longest T, as `merge` does)."""
    forming, started = times
    rows = tokens = t_max = 0
    for b, t in shapes:  # one pass: this runs for every batch, most of them one request
        rows, tokens, t_max = rows + b, tokens + b * t, max(t_max, t)
    return BatchEvent(
        requests=len(shapes),
        rows=rows,
        seqs=tuple(t for _, t in shapes),
        padded_tokens=rows * t_max - tokens,
        formation_s=started - forming,
        compute_s=now - started,
        backend=backend,
        error=error,
        ended=now,
        traced=traced,
        input_s=phases[0],
        output_s=phases[1],
    )
