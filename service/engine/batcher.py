"""Dynamic batching of stateless requests: a bounded queue, batches formed within a delay.

`Batcher`, on an injected `Clock`, runs each batch on its worker thread (or, alone in the server
and small, on the event loop: `InlineGate`) and reports one `BatchEvent` per executed batch. What
it decides with and how it pads are the pure primitives of `service.batching`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np

from service.batching import (
    BatcherConfig,
    BatchEvent,
    Clock,
    InlineGate,
    MonotonicClock,
    Pending,
    batch_event,
    form_at,
    merge,
    plan_batch,
    run_each_alone,
    split,
    traced,
)
from service.errors import DeadlineExceeded, NotReady, Overloaded

log = logging.getLogger(__name__)

RunBatch = Callable[[np.ndarray], tuple[np.ndarray, str]]  # (B, T, C) -> ((B, T, C), backend name)


class Timing(NamedTuple):
    """What a request learns of the batch it rode in."""

    queue_s: float  # enqueued -> its batch started computing
    backend: str


Answer = tuple[np.ndarray, Timing]
Queued = Pending[np.ndarray, Answer]  # the payload: x (B, T, C)


class Batcher:
    def __init__(
        self,
        config: BatcherConfig,
        run_batch: RunBatch,
        executor: Executor,
        on_batch: Callable[[BatchEvent], None] | None = None,
        in_flight: Callable[[], int] | None = None,
        clock: Clock | None = None,
        current_trace: Callable[[], object] | None = None,
    ) -> None:
        self.config = config
        self._run_batch = run_batch
        self._executor = executor
        self._on_batch = on_batch
        self._in_flight = in_flight  # requests in the server, queued or not; None: assume more may come
        self._gate = InlineGate(in_flight, config.inline_max_mflop)
        self.clock: Clock = clock or MonotonicClock()
        self._queue: list[Queued] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._current_trace = current_trace  # the calling request's span (tracing on), for the batch's

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
        trace = self._current_trace() if self._current_trace is not None else None
        if self._gate.inline(1, x.shape, len(self._queue)):
            return self._run_alone(x, enqueued, deadline, trace)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._queue.append(Pending(x, x.shape, future, enqueued, deadline, trace))
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
                await self._execute(plan.batch, forming)

    async def _wait_for_company(self) -> None:
        while self._queue and not self._closed:
            more_may_come = self._in_flight is None or self._in_flight() > len(self._queue)
            until = form_at(self._queue, self.config, more_may_come)
            if until <= self.clock.now():
                return
            self._wakeup.clear()
            await self.clock.wait(self._wakeup, until)

    def _expire(self, expired: list[Queued]) -> None:
        now = self.clock.now()
        for item in expired:
            waited_ms = (now - item.enqueued) * 1e3
            item.future.set_exception(DeadlineExceeded(f"deadline passed after {waited_ms:.1f} ms in the queue"))

    async def _execute(self, batch: list[Queued], forming: float) -> None:
        x = merge([i.payload for i in batch])  # (sum B, T_max, C)
        shapes = [(i.rows, i.seq) for i in batch]
        started = self.clock.now()
        try:
            if self._gate.inline(len(batch), x.shape, len(self._queue)):
                y, backend = self._run_batch(x)
            else:
                self._gate.computing = True
                try:
                    y, backend = await asyncio.get_running_loop().run_in_executor(self._executor, self._run_batch, x)
                finally:
                    self._gate.computing = False
        except Exception as exc:
            self._report(shapes, (forming, started), "", exc, traced(batch))
            if len(batch) > 1:  # isolate the culprit: one request's failure never fails the others
                await run_each_alone(batch, lambda one: self._execute(one, self.clock.now()))
            elif not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        self._report(shapes, (forming, started), backend, None, traced(batch))
        for item, out in zip(batch, split(y, shapes), strict=True):
            if not item.future.done():
                item.future.set_result((out, Timing(started - item.enqueued, backend)))

    def _run_alone(self, x: np.ndarray, enqueued: float, deadline: float | None, trace: object) -> Answer:
        """A small request computed at once on the event loop, without the queue, a future or the
        batcher's task (each a turn of the loop): the only request in the server."""
        started = self.clock.now()
        if deadline is not None and deadline <= started:
            raise DeadlineExceeded(f"deadline passed after {(started - enqueued) * 1e3:.1f} ms in the queue")
        shapes = [(int(x.shape[0]), int(x.shape[1]))]
        spans = ((trace, enqueued),) if trace is not None else ()
        try:
            y, backend = self._run_batch(x)
        except Exception as exc:
            self._report(shapes, (started, started), "", exc, spans)
            raise
        self._report(shapes, (started, started), backend, None, spans)
        return y, Timing(started - enqueued, backend)

    def _report(
        self,
        shapes: list[tuple[int, int]],
        times: tuple[float, float],
        backend: str,
        error: BaseException | None,
        spans: tuple[tuple[object, float], ...],
    ) -> None:
        if self._on_batch is not None:
            self._on_batch(batch_event(shapes, times, self.clock.now(), backend, error, spans))
