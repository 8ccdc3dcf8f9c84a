"""Batching primitives shared by the stateless batcher (engine/) and the step scheduler (decode/).

No gRPC, no ONNX, no torch: numpy and asyncio only.
- deciding, pure (no event loop, no clock): `plan_batch` says which queued requests form the next
  batch and which are dead; `form_at` says until when the oldest request may wait for company;
  `InlineGate` says whether a small batch alone in the server runs on the event loop;
- moving arrays, pure: `merge` right-pads requests of different T into one batch and `split`
  slices the outputs back. Padding is exact for causal attention (position t only attends to
  positions <= t); non-causal models merge only equal T;
- time: the injected `Clock`, and `BatchEvent`, what one executed batch reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
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
    inline_max_mflop: float = 0.0  # batches this small, alone in the server, run on the event loop


# Deciding ----------------------------------------------------------------------------------


def batch_mflop(rows: int, seq: int, width: int) -> float:
    """Work of one forward pass over (rows, seq, width): four projections and the two
    attention products, in millions of floating-point operations."""
    return (8 * rows * seq * width * width + 4 * rows * seq * seq * width) / 1e6


P = TypeVar("P")  # what a waiting request carries
R = TypeVar("R")  # what its caller awaits


@dataclass(eq=False)
class Pending(Generic[P, R]):
    """A request waiting in a batcher: what it carries and the future its caller awaits. Both
    batchers queue these (engine/batcher.py and decode/scheduler.py)."""

    payload: P
    shape: tuple[int, ...]  # (B, T, C) of its tensor
    future: asyncio.Future[R]
    enqueued: float = 0.0  # clock time
    deadline: float | None = None  # clock time
    trace: Any = None  # the span of the call that waits, when it is traced

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


class InlineGate:
    """The one policy for small requests when the server is idle: a batch is computed on the
    event loop's thread, without the hop to the worker thread and back, when its requests are
    all the server holds (`in_flight`), nothing waits in its batcher's queue, no batch of its
    batcher is computing (one whose client left may still be), and its work is at most
    `max_mflop`. Then no request waits for the loop while it computes. Shared by both batchers,
    each with its own queue and computing flag."""

    def __init__(self, in_flight: Callable[[], int] | None, max_mflop: float) -> None:
        self._in_flight = in_flight  # requests in the server, queued or not; None: unknown, assume others
        self.max_mflop = max_mflop
        self.computing = False  # a batch of this batcher is being computed on the worker thread

    def inline(self, requests: int, shape: tuple[int, ...], queued: int) -> bool:
        """Compute a batch of `requests` and `shape` (rows, T, C) on the loop?"""
        if self.computing or queued or self._in_flight is None or self._in_flight() > requests:
            return False
        return batch_mflop(*shape[:3]) <= self.max_mflop


async def run_each_alone(batch: Sequence[Pending[P, R]], run: Callable[[list[Pending[P, R]]], Awaitable[None]]) -> None:
    """After a batch failed: each request still awaited, once more on its own, so that one
    request's failure never fails another's (a cancelled one is not computed again)."""
    for item in batch:
        if not item.gone:
            await run([item])


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


def plan_batch(queue: Sequence[Q], config: BatcherConfig, now: float) -> Plan[Q]:
    """Which requests form the next batch; dead ones are set apart and never computed. One pass
    over the queue: the batch's rows, longest T and tokens are kept as requests join it."""
    gone, expired, live = list[Q](), list[Q](), list[Q]()
    for q in queue:
        if q.gone:
            gone.append(q)
        elif q.deadline is not None and q.deadline <= now:
            expired.append(q)
        else:
            live.append(q)
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
    """One executed batch, for metrics and statistics. Built once per batch and never changed (not
    frozen: a frozen dataclass sets each field through object.__setattr__, 5x the cost, on the
    path of every request)."""

    requests: int
    rows: int
    seqs: tuple[int, ...]  # T of each request, in batch order
    padded_tokens: int
    formation_s: float  # the batcher began forming it -> it began computing
    compute_s: float
    backend: str  # "" when it failed
    error: BaseException | None = None
    ended: float = 0.0  # clock time the compute ended (the event's `now`)
    traced: tuple[tuple[Any, float], ...] = ()  # (span, enqueued) of each traced request: tracing's


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
    )
