"""The one batching engine, for stateless requests and decode steps alike.

A bounded queue in front of a worker thread: requests wait as `Pending`, a batch is formed (when,
and of which requests, is passed in: `form_at` and `plan`), computed off the event loop
(`compute`, given the batch's payloads), reported once (`on_batch`, a `BatchEvent`) and answered
request by request (`deliver` turns an output into the caller's answer: a decode step commits
there). One deadline path, one message; requests nobody waits for any more are never computed;
a failed batch is computed again request by request, so that one request's failure never fails
another's, unless the device itself is lost (every request fails alike).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, NamedTuple, TypeVar

from service.batching import BatchEvent, Clock, MonotonicClock, Pending, Plan, batch_event, traced
from service.errors import DeadlineExceeded, DeviceLost, NotReady
from service.scheduling import SchedulePolicy, WaitQueue

log = logging.getLogger(__name__)

P = TypeVar("P")  # what a request carries: x (B, T, C), or a decode step
A = TypeVar("A")  # what its caller gets: y (B, T, C), or a step's y once committed


class Timing(NamedTuple):
    """What a request learns of the batch it rode in."""

    queue_s: float  # enqueued -> its batch started computing
    backend: str
    compute: tuple[float, float, float] = (0.0, 0.0, 0.0)  # its batch's (input, inference, output) seconds
    finite: bool = False  # every output of its batch is finite (checked once, off the loop); False: unknown


class Computed(NamedTuple):
    """What a compute returns: an output per request, the backend, and the time it spent making
    the batch's input and slicing its outputs (the rest of the compute is the inference)."""

    outputs: list[Any]
    backend: str
    input_s: float = 0.0
    output_s: float = 0.0
    finite: bool = False  # every output is known to be finite


Item = Pending[Any, tuple[Any, Timing]]
Planner = Callable[[Sequence[Item], float], Plan[Item]]  # (queue, now) -> the next batch
FormAt = Callable[[Sequence[Item], bool], float]  # (queue, more may come) -> clock time to form at
Compute = Callable[[list[Any]], Computed]  # payloads -> an output each, and more; on the worker thread


class BatchEngine(Generic[P, A]):
    def __init__(
        self,
        plan: Planner,
        form_at: FormAt,
        compute: Compute,
        executor: Executor,
        max_queue_size: int,
        deliver: Callable[[P, Any], A] | None = None,
        on_batch: Callable[[BatchEvent], None] | None = None,
        in_flight: Callable[[], int] | None = None,
        clock: Clock | None = None,
        current_trace: Callable[[], object] | None = None,
        schedule: SchedulePolicy | None = None,
    ) -> None:
        self._plan, self._form_at, self._compute, self._executor = plan, form_at, compute, executor
        self._deliver = deliver  # None: the output is the answer
        self._on_batch = on_batch
        self._in_flight = in_flight  # requests in the server, queued or not; None: assume more may come
        self.clock: Clock = clock or MonotonicClock()
        self._current_trace = current_trace  # the calling request's span (tracing on), for the batch's
        self._waiting = WaitQueue[Item](schedule or SchedulePolicy(), max_queue_size)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timeouts = QueueTimeouts(self._waiting, self.clock, self._wakeup.set)
        self._closed = False

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def _queue(self) -> list[Item]:
        return self._waiting.items

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-engine")
        self._timeouts.start()

    async def stop(self) -> None:
        """Stop taking requests, finish what is queued, then end the loop."""
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        await self._timeouts.stop()

    async def submit(
        self,
        payload: P,
        shape: tuple[int, ...],
        deadline: float | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[A, Timing]:
        """Queue `payload` of `shape` (B, T, C) at `priority` (0: the default level), `timeout_s`
        the request's own queue timeout; resolve to its answer and Timing. Raises Overloaded at once
        when the queue (or its level's) is full, NotReady once stopping."""
        if self._closed or self._task is None:
            raise NotReady("the server is draining; retry on another replica")
        trace = self._current_trace() if self._current_trace is not None else None
        future: asyncio.Future[tuple[A, Timing]] = asyncio.get_running_loop().create_future()
        now = self.clock.now()
        if self._waiting.admit(Pending(payload, shape, future, now, deadline, trace), priority, timeout_s, now):
            self._timeouts.sooner()
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
            now = self.clock.now()
            self._timeouts.apply(now)
            plan = self._plan(self._waiting.in_order(), now)
            self._waiting.leave(plan.batch, plan.rest)
            self._expire(plan.expired)
            if plan.batch:
                await self._execute(plan.batch, forming)

    async def _wait_for_company(self) -> None:
        while self._queue and not self._closed:
            more_may_come = self._in_flight is None or self._in_flight() > len(self._queue)
            until = self._form_at(self._queue, more_may_come)
            if until <= self.clock.now():
                return
            self._wakeup.clear()
            await self.clock.wait(self._wakeup, until)

    def _expire(self, expired: Sequence[Item]) -> None:
        now = self.clock.now()
        for item in expired:
            waited_ms = (now - item.enqueued) * 1e3
            item.future.set_exception(DeadlineExceeded(f"deadline passed after {waited_ms:.1f} ms in the queue"))

    async def _execute(self, batch: list[Item], forming: float) -> None:
        shapes = [(item.rows, item.seq) for item in batch]
        started = self.clock.now()
        payloads = [item.payload for item in batch]
        try:
            computed = await asyncio.get_running_loop().run_in_executor(self._executor, self._compute, payloads)
        except Exception as exc:
            self._report(shapes, (forming, started), "", exc, batch)
            if len(batch) > 1 and not isinstance(exc, DeviceLost):  # isolate the culprit
                for item in batch:
                    if not item.gone:
                        await self._execute([item], self.clock.now())
                return
            for item in batch:  # alone, or a lost device: every request fails alike
                if not item.gone:
                    item.future.set_exception(exc)
            return
        event = self._report(shapes, (forming, started), computed.backend, None, batch, computed)
        phases = (event.input_s, event.infer_s, event.output_s)
        for item, output in zip(batch, computed.outputs, strict=True):
            timing = Timing(started - item.enqueued, computed.backend, phases, computed.finite)
            self._answer(item, output, timing)

    def _answer(self, item: Item, output: Any, timing: Timing) -> None:
        """Answer `item`, if its caller still waits: an abandoned request is never delivered (a
        decode step commits nothing); a delivery that raises fails that request alone."""
        if item.gone:
            return
        try:
            answer = self._deliver(item.payload, output) if self._deliver is not None else output
        except Exception as exc:  # the output says the request was the client's mistake
            item.future.set_exception(exc)
            return
        item.future.set_result((answer, timing))

    def _report(
        self,
        shapes: list[tuple[int, int]],
        times: tuple[float, float],
        backend: str,
        error: BaseException | None,
        batch: list[Item],
        computed: Computed | None = None,
    ) -> BatchEvent:
        phases = (computed.input_s, computed.output_s) if computed is not None else (0.0, 0.0)
        event = batch_event(shapes, times, self.clock.now(), backend, error, traced(batch), phases)
        if self._on_batch is not None:
            self._on_batch(event)
        return event


class QueueTimeouts:
    """Queue timeouts fired on time, whether or not a batch is forming or computing (Triton's fire
    only when the next batch forms): a task sleeps on the engine's clock until the earliest one;
    REJECT answers DEADLINE_EXCEEDED there and then, DELAY moves the request behind its level."""

    def __init__(self, waiting: WaitQueue[Item], clock: Clock, changed: Callable[[], None]) -> None:
        self._waiting, self._clock, self._changed = waiting, clock, changed
        self._sooner = asyncio.Event()  # a sooner timeout to watch, or stopping
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="batch-engine-timeouts")

    async def stop(self) -> None:
        self._stopping = True
        self._sooner.set()
        if self._task is not None:
            await self._task

    def sooner(self) -> None:
        self._sooner.set()

    async def _watch(self) -> None:
        while not self._stopping:
            self._sooner.clear()
            if (until := self._waiting.next_timeout) == float("inf"):
                await self._sooner.wait()
            else:
                await self._clock.wait(self._sooner, until)
            self.apply(self._clock.now())

    def apply(self, now: float) -> None:
        """Apply the timeouts passed by `now` (also just before a batch is planned)."""
        if self._waiting.next_timeout > now:
            return
        for item in self._waiting.time_out(now):
            waited_ms = (now - item.enqueued) * 1e3
            message = f"queue timeout passed after {waited_ms:.1f} ms in the queue (priority level {item.level})"
            item.future.set_exception(DeadlineExceeded(message))
        self._changed()  # the queue changed: the engine looks again
