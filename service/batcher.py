"""Dynamic batching: a bounded queue, batches formed within a delay, padding bounded.

No gRPC or ONNX here. Requests with different T share a batch by right-padding to the batch's
longest T, which is exact for causal attention (position t only attends to positions <= t);
outputs are sliced back per request. Non-causal models merge only equal T.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

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


@dataclass
class Timing:
    """Per-request timing points, seconds."""

    queue_s: float = 0.0  # enqueue -> batch starts computing
    compute_s: float = 0.0  # backend time of the batch it rode in
    batch_rows: int = 0  # rows in that batch
    backend: str = ""


@dataclass
class _Item:
    x: np.ndarray  # (B, T, C)
    future: asyncio.Future[tuple[np.ndarray, Timing]]
    deadline: float | None  # time.monotonic()
    enqueued: float

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def seq(self) -> int:
        return int(self.x.shape[1])


@dataclass
class BatcherCounters:
    """The batcher's own counters (tests and ModelStatistics read them)."""

    batches: int = 0
    rows: int = 0
    requests: int = 0
    merged_batches: int = 0  # batches that carried more than one request
    mixed_t_batches: int = 0  # batches that carried more than one T
    padded_tokens: int = 0
    rejected_full: int = 0
    expired: int = 0
    cancelled: int = 0
    failed_batches: int = 0
    largest_batch_rows: int = 0


class Batcher:
    def __init__(
        self,
        config: BatcherConfig,
        run_batch: RunBatch,
        executor: Executor,
        on_batch: Callable[[int, float, float, str], None] | None = None,
        in_flight: Callable[[], int] | None = None,
    ) -> None:
        self.config = config
        self._run_batch = run_batch
        self._executor = executor
        self._on_batch = on_batch  # (rows, formation_s, compute_s, backend)
        self._in_flight = in_flight  # requests in the server; None: assume more may come
        self._queue: deque[_Item] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.counters = BatcherCounters()

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

    async def submit(self, x: np.ndarray, deadline: float | None = None) -> tuple[np.ndarray, Timing]:
        """Queue (B, T, C); resolve to ((B, T, C), Timing). Raises Overloaded when full."""
        if self._closed:
            raise NotReady("the server is draining; retry on another replica")
        if len(self._queue) >= self.config.max_queue_size:
            self.counters.rejected_full += 1
            raise Overloaded(
                f"queue full: {len(self._queue)} requests waiting (max_queue_size {self.config.max_queue_size}); "
                "retry with backoff"
            )
        future: asyncio.Future[tuple[np.ndarray, Timing]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Item(x=x, future=future, deadline=deadline, enqueued=time.monotonic()))
        self._wakeup.set()
        return await future

    async def _loop(self) -> None:
        while True:
            if not self._queue:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            formation_start = time.monotonic()
            await self._wait_for_company()
            batch = self._take_batch()
            if batch:
                await self._execute(batch, time.monotonic() - formation_start)

    def _more_may_come(self) -> bool:
        """Is any request in the server that is not queued yet? Without one, waiting only adds latency."""
        return self._in_flight is None or self._in_flight() > len(self._queue)

    async def _wait_for_company(self) -> None:
        """Wait up to max_queue_delay for the queue to hold a full batch, while more may come."""
        cfg = self.config
        if cfg.max_batch_size <= 1 or cfg.max_queue_delay_s <= 0:
            return
        deadline = self._queue[0].enqueued + cfg.max_queue_delay_s
        while sum(i.rows for i in self._queue) < cfg.max_batch_size and not self._closed and self._more_may_come():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _drop_dead(self) -> None:
        now = time.monotonic()
        alive: deque[_Item] = deque()
        for item in self._queue:
            if item.future.done():  # cancelled by the client going away
                self.counters.cancelled += 1
            elif item.deadline is not None and item.deadline <= now:
                self.counters.expired += 1
                waited = now - item.enqueued
                item.future.set_exception(DeadlineExceeded(f"deadline passed after {waited * 1e3:.1f} ms in the queue"))
            else:
                alive.append(item)
        self._queue = alive

    def _take_batch(self) -> list[_Item]:
        """The oldest request, plus the queued requests that fit with it (FIFO order)."""
        self._drop_dead()
        if not self._queue:
            return []
        first = self._queue.popleft()
        batch, rows, tokens, t_max = [first], first.rows, first.rows * first.seq, first.seq
        keep: deque[_Item] = deque()
        for item in self._queue:
            if rows + item.rows > self.config.max_batch_size or not self._compatible(item, rows, tokens, t_max):
                keep.append(item)
                continue
            batch.append(item)
            rows, tokens, t_max = rows + item.rows, tokens + item.rows * item.seq, max(t_max, item.seq)
        self._queue = keep
        return batch

    def _compatible(self, item: _Item, rows: int, tokens: int, t_max: int) -> bool:
        if not self.config.causal:
            return item.seq == t_max
        new_max = max(t_max, item.seq)
        padded = (rows + item.rows) * new_max
        waste = (padded - tokens - item.rows * item.seq) / padded
        return waste <= self.config.max_padding_ratio

    async def _execute(self, batch: list[_Item], formation_s: float) -> None:
        x = _pad_and_stack([i.x for i in batch])  # (sum B, T_max, C)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            y, backend = await loop.run_in_executor(self._executor, self._run_batch, x)
        except Exception as exc:  # a failed batch fails every waiter with the same error
            self.counters.failed_batches += 1
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        compute_s = time.monotonic() - started
        self._count(batch, x)
        if self._on_batch is not None:
            self._on_batch(x.shape[0], formation_s, compute_s, backend)
        offset = 0
        for item in batch:
            out = y[offset : offset + item.rows, : item.seq]  # (B_i, T_i, C)
            offset += item.rows
            if not item.future.done():
                timing = Timing(
                    queue_s=started - item.enqueued, compute_s=compute_s, batch_rows=x.shape[0], backend=backend
                )
                item.future.set_result((out, timing))

    def _count(self, batch: list[_Item], x: np.ndarray) -> None:
        c = self.counters
        rows = int(x.shape[0])
        c.batches += 1
        c.rows += rows
        c.requests += len(batch)
        c.merged_batches += len(batch) > 1
        c.mixed_t_batches += len({i.seq for i in batch}) > 1
        c.padded_tokens += rows * x.shape[1] - sum(i.rows * i.seq for i in batch)
        c.largest_batch_rows = max(c.largest_batch_rows, rows)


def _pad_and_stack(xs: list[np.ndarray]) -> np.ndarray:
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
