"""Dynamic batching: a bounded queue, batches formed within a delay, padding bounded.

No gRPC or ONNX here, and three parts that can each be read alone:
- deciding, pure (no event loop, no clock): `plan_batch` says which queued requests form the next
  batch and which are dead; `form_at` says until when the oldest request may wait for company;
- moving arrays, pure: `merge` right-pads requests of different T into one batch and `split`
  slices the outputs back. Padding is exact for causal attention (position t only attends to
  positions <= t); non-causal models merge only equal T;
- waiting and running: `Batcher`, on an injected `Clock`, runs each batch off the event loop and
  reports one `BatchEvent` per executed batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from service.errors import DeadlineExceeded, NotReady, Overloaded

log = logging.getLogger(__name__)

RunBatch = Callable[[np.ndarray], tuple[np.ndarray, str]]  # (B, T, C) -> ((B, T, C), backend name)


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 8  # rows (sum of B) per executed batch; 1 turns batching off
    max_queue_delay_s: float = 0.002  # how long the first request waits for company
    max_queue_size: int = 256  # requests waiting (not rows); beyond it: RESOURCE_EXHAUSTED
    max_padding_ratio: float = 0.25  # padded tokens / batch tokens allowed when merging T
    causal: bool = True  # merging different T is exact only for causal attention
    max_cells: int | None = None  # rows x T_max x T_max a merged batch may reach (its attention memory)
    inline_max_mflop: float = 0.0  # batches this small run on the event loop: a thread hop costs more


# Deciding ----------------------------------------------------------------------------------


def batch_mflop(rows: int, seq: int, width: int) -> float:
    """Work of one forward pass over (rows, seq, width): four projections and the two
    attention products, in millions of floating-point operations."""
    return (8 * rows * seq * width * width + 4 * rows * seq * seq * width) / 1e6


async def alone_and_small(
    requests: int, shape: tuple[int, ...], inline_max_mflop: float, alone: Callable[[], bool]
) -> bool:
    """Whether to compute a batch of `shape` (rows, T, C) on the event loop's thread: one request,
    at most `inline_max_mflop` of work, and nothing else in the server (`alone`). One turn of the
    loop first lets requests that have already arrived show up; then the batch goes to the worker
    thread instead, and they gather while it computes. Shared by the batcher and the step batcher."""
    if requests > 1 or batch_mflop(*shape[:3]) > inline_max_mflop or not alone():
        return False
    await asyncio.sleep(0)
    return alone()


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
    """Which requests form the next batch; dead ones are set apart and never computed."""
    gone = [q for q in queue if q.gone]
    expired = [q for q in queue if not q.gone and q.deadline is not None and q.deadline <= now]
    live = [q for q in queue if not q.gone and (q.deadline is None or q.deadline > now)]
    if not live:
        return Plan(batch=[], rest=[], expired=expired, gone=gone)
    batch, rest = [live[0]], list[Q]()
    for item in live[1:]:
        (batch if _fits(batch, item, config) else rest).append(item)
    return Plan(batch=batch, rest=rest, expired=expired, gone=gone)


def _fits(batch: Sequence[Queued], item: Queued, config: BatcherConfig) -> bool:
    rows = sum(q.rows for q in batch) + item.rows
    if rows > config.max_batch_size:
        return False
    t_max = max(q.seq for q in batch)
    if config.max_cells is not None and rows * max(t_max, item.seq) ** 2 > config.max_cells:
        return False
    if not config.causal:
        return item.seq == t_max
    padded = rows * max(t_max, item.seq)
    tokens = sum(q.rows * q.seq for q in batch) + item.rows * item.seq
    return (padded - tokens) / padded <= config.max_padding_ratio


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


# Waiting and running -------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Timing:
    """What a request learns of the batch it rode in."""

    queue_s: float  # enqueued -> its batch started computing
    batch_rows: int
    backend: str


Answer = tuple[np.ndarray, Timing]


@dataclass(frozen=True)
class BatchEvent:
    """One executed batch, for metrics and statistics."""

    requests: int
    rows: int
    seqs: tuple[int, ...]  # T of each request, in batch order
    padded_tokens: int
    formation_s: float  # the batcher began forming it -> it began computing
    compute_s: float
    backend: str  # "" when it failed
    error: BaseException | None = None


@dataclass(eq=False)
class _Pending:
    x: np.ndarray  # (B, T, C)
    enqueued: float
    deadline: float | None
    future: asyncio.Future[Answer]

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def seq(self) -> int:
        return int(self.x.shape[1])

    @property
    def gone(self) -> bool:
        return self.future.done()


class Batcher:
    def __init__(
        self,
        config: BatcherConfig,
        run_batch: RunBatch,
        executor: Executor,
        on_batch: Callable[[BatchEvent], None] | None = None,
        in_flight: Callable[[], int] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self._run_batch = run_batch
        self._executor = executor
        self._on_batch = on_batch
        self._in_flight = in_flight  # requests in the server, queued or not; None: assume more may come
        self.clock: Clock = clock or MonotonicClock()
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._computing = False  # a batch of the loop is being computed (on the worker thread)

    @property
    def depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        """Stop taking requests, finish what is queued, then end the loop."""
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    async def submit(self, x: np.ndarray, deadline: float | None = None) -> Answer:
        """Queue (B, T, C); resolve to ((B, T, C), Timing). Raises Overloaded at once when full."""
        if self._closed:
            raise NotReady("the server is draining; retry on another replica")
        if len(self._queue) >= self.config.max_queue_size:
            raise Overloaded(
                f"queue full: {len(self._queue)} requests waiting (max_queue_size {self.config.max_queue_size}); "
                "retry with backoff"
            )
        enqueued = self.clock.now()
        if await alone_and_small(1, x.shape, self.config.inline_max_mflop, self._idle_and_alone):
            return self._run_alone(x, enqueued, deadline)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(x=x, enqueued=enqueued, deadline=deadline, future=future))
        self._wakeup.set()
        return await future

    async def _loop(self) -> None:
        while self._queue or not self._closed:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            forming = self.clock.now()
            await self._wait_for_company()
            plan = plan_batch(self._queue, self.config, self.clock.now())
            self._queue = plan.rest
            self._expire(plan.expired)
            if plan.batch:
                self._computing = True
                try:
                    await self._execute(plan.batch, forming)
                finally:
                    self._computing = False

    async def _wait_for_company(self) -> None:
        while self._queue and not self._closed:
            more_may_come = self._in_flight is None or self._in_flight() > len(self._queue)
            until = form_at(self._queue, self.config, more_may_come)
            if until <= self.clock.now():
                return
            self._wakeup.clear()
            await self.clock.wait(self._wakeup, until)

    def _expire(self, expired: list[_Pending]) -> None:
        now = self.clock.now()
        for item in expired:
            waited_ms = (now - item.enqueued) * 1e3
            item.future.set_exception(DeadlineExceeded(f"deadline passed after {waited_ms:.1f} ms in the queue"))

    async def _execute(self, batch: list[_Pending], forming: float) -> None:
        x = merge([i.x for i in batch])  # (sum B, T_max, C)
        shapes = [(i.rows, i.seq) for i in batch]
        started = self.clock.now()
        try:
            if await alone_and_small(len(batch), x.shape, self.config.inline_max_mflop, self._alone):
                y, backend = self._run_batch(x)
            else:
                y, backend = await asyncio.get_running_loop().run_in_executor(self._executor, self._run_batch, x)
        except Exception as exc:
            self._report(shapes, x, (forming, started), "", exc)
            if len(batch) > 1:  # isolate the culprit: one request's failure never fails the others
                for item in batch:
                    if not item.future.done():
                        await self._execute([item], self.clock.now())
            elif not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        self._report(shapes, x, (forming, started), backend, None)
        for item, out in zip(batch, split(y, shapes), strict=True):
            if not item.future.done():
                item.future.set_result((out, Timing(started - item.enqueued, int(x.shape[0]), backend)))

    def _run_alone(self, x: np.ndarray, enqueued: float, deadline: float | None) -> Answer:
        """The only request in the server, small: computed here on the event loop, without the
        queue, a future or the batcher's task (each a turn of the loop)."""
        started = self.clock.now()
        if deadline is not None and deadline <= started:
            raise DeadlineExceeded(f"deadline passed after {(started - enqueued) * 1e3:.1f} ms in the queue")
        shapes = [(int(x.shape[0]), int(x.shape[1]))]
        try:
            y, backend = self._run_batch(x)
        except Exception as exc:
            self._report(shapes, x, (started, started), "", exc)
            raise
        self._report(shapes, x, (started, started), backend, None)
        return y, Timing(started - enqueued, int(x.shape[0]), backend)

    def _alone(self) -> bool:
        """Nothing queued and no other request in the server (unknown without `in_flight`: no)."""
        return not self._queue and self._in_flight is not None and self._in_flight() <= 1

    def _idle_and_alone(self) -> bool:
        """Alone, and no batch computing: a request whose client went away may still be."""
        return not self._computing and self._alone()

    def _report(
        self,
        shapes: list[tuple[int, int]],
        x: np.ndarray,
        times: tuple[float, float],
        backend: str,
        error: BaseException | None,
    ) -> None:
        if self._on_batch is not None:
            self._on_batch(batch_event(shapes, x, times, self.clock.now(), backend, error))


def batch_event(
    shapes: list[tuple[int, int]],  # (B, T) of each request, in batch order
    x: np.ndarray,  # the merged batch
    times: tuple[float, float],  # (formation began, compute began)
    now: float,
    backend: str,
    error: BaseException | None,
) -> BatchEvent:
    (forming, started), rows = times, int(x.shape[0])
    return BatchEvent(
        requests=len(shapes),
        rows=rows,
        seqs=tuple(seq for _, seq in shapes),
        padded_tokens=rows * int(x.shape[1]) - sum(b * t for b, t in shapes),
        formation_s=started - forming,
        compute_s=now - started,
        backend=backend,
        error=error,
    )
