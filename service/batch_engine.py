"""The one batching engine, for stateless requests and decode steps alike.

A bounded queue in front of a worker thread: requests wait as `Pending`, a batch is formed (when,
and of which requests, is the subclass's to say: `form_at` and `plan`), computed off the event
loop (`compute`, given the batch's payloads), reported once (`on_batch`, a `BatchEvent`) and
answered request by request (`deliver` turns an output into the caller's answer: a decode step
commits there). One deadline path, one message; requests nobody waits for any more are never computed;
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


class Hooks(NamedTuple):
    """What the engine tells the server, and asks it."""

    on_batch: Callable[[BatchEvent], None] | None = None  # each batch, once
    in_flight: Callable[[], int] | None = None  # requests in the server, queued or not; None: more may come
    current_trace: Callable[[], object] | None = None  # the calling request's span (tracing on), for the batch's


class BatchEngine(Generic[P, A]):
    """Subclasses say how batches form (`plan`, `form_at`), compute and answer (`compute`, `deliver`)."""

    def __init__(
        self,
        executor: Executor,
        max_queue_size: int,
        on_batch: Callable[[BatchEvent], None] | None = None,
        in_flight: Callable[[], int] | None = None,
        clock: Clock | None = None,
        current_trace: Callable[[], object] | None = None,
        schedule: SchedulePolicy | None = None,
    ) -> None:
        self._executor = executor
        self._hooks = Hooks(on_batch, in_flight, current_trace)
        self.clock: Clock = clock or MonotonicClock()
        self._waiting = Waiting(WaitQueue[Item](schedule or SchedulePolicy(), max_queue_size), self.clock)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def plan(self, queue: Sequence[Item], now: float) -> Plan[Item]:
        """The next batch of `queue` (in order), what stays, and what expired."""
        raise NotImplementedError

    def form_at(self, queue: Sequence[Item], more_may_come: bool) -> float:
        """The clock time to form the next batch at."""
        raise NotImplementedError

    def compute(self, payloads: list[Any]) -> Computed:
        """The batch's payloads -> an output each, and more; on the worker thread."""
        raise NotImplementedError

    def deliver(self, payload: P, output: Any) -> A:
        """An output turned into its caller's answer (by default, the output itself)."""
        return output  # type: ignore[no-any-return]

    @property
    def depth(self) -> int:
        return len(self._waiting.queue)

    @property
    def _queue(self) -> list[Item]:
        return self._waiting.queue.items

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-engine")
        self._waiting.start()

    async def stop(self) -> None:
        """Stop taking requests, finish what is queued, then end the loop."""
        self._closed = True
        self._waiting.wakeup.set()
        if self._task is not None:
            await self._task
        await self._waiting.stop()

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
        current_trace, waiting = self._hooks.current_trace, self._waiting
        trace = current_trace() if current_trace is not None else None
        future: asyncio.Future[tuple[A, Timing]] = asyncio.get_running_loop().create_future()
        now = self.clock.now()
        if waiting.queue.admit(Pending(payload, shape, future, now, deadline, trace), priority, timeout_s, now):
            waiting.sooner()
        waiting.wakeup.set()
        return await future

    async def _loop(self) -> None:
        while self._queue or not self._closed:
            if not self._queue:
                self._waiting.wakeup.clear()
                await self._waiting.wakeup.wait()
                continue
            forming = self.clock.now()
            await self._wait_for_company()
            now = self.clock.now()
            self._waiting.apply(now)
            plan = self.plan(self._waiting.queue.in_order(), now)
            self._waiting.queue.leave(plan.batch, plan.rest)
            _expire(plan.expired, self.clock.now())
            if plan.batch:
                await self._execute(plan.batch, forming)
            del plan  # its requests go now, not when the next batch forms (an ended sequence's cache with them)

    async def _wait_for_company(self) -> None:
        while self._queue and not self._closed:
            in_flight = self._hooks.in_flight
            more_may_come = in_flight is None or in_flight() > len(self._queue)
            until = self.form_at(self._queue, more_may_come)
            if until <= self.clock.now():
                return
            self._waiting.wakeup.clear()
            await self.clock.wait(self._waiting.wakeup, until)

    async def _execute(self, batch: list[Item], forming: float) -> None:
        started = self.clock.now()
        payloads = [item.payload for item in batch]
        try:
            computed = await asyncio.get_running_loop().run_in_executor(self._executor, self.compute, payloads)
        except Exception as exc:
            self._report(batch, (forming, started), exc)
            if len(batch) > 1 and not isinstance(exc, DeviceLost):  # isolate the culprit
                for item in batch:
                    if not item.gone:
                        await self._execute([item], self.clock.now())
                return
            for item in batch:  # alone, or a lost device: every request fails alike
                if not item.gone:
                    item.future.set_exception(exc)
            return
        event = self._report(batch, (forming, started), None, computed)
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
            answer = self.deliver(item.payload, output)
        except Exception as exc:  # the output says the request was the client's mistake
            item.future.set_exception(exc)
            return
        item.future.set_result((answer, timing))

    def _report(
        self, batch: list[Item], times: tuple[float, float], error: BaseException | None, out: Computed | None = None
    ) -> BatchEvent:
        shapes = [(item.rows, item.seq) for item in batch]
        backend, phases = (out.backend, (out.input_s, out.output_s)) if out is not None else ("", (0.0, 0.0))
        event = batch_event(shapes, times, self.clock.now(), backend, error, traced(batch), phases)
        if self._hooks.on_batch is not None:
            self._hooks.on_batch(event)
        return event


def _expire(expired: Sequence[Item], now: float) -> None:
    for item in expired:
        waited_ms = (now - item.enqueued) * 1e3
        item.future.set_exception(DeadlineExceeded(f"deadline passed after {waited_ms:.1f} ms in the queue"))


class Waiting:
    """The requests waiting: their queue, the event that wakes the engine's loop when it changes,
    and its queue timeouts, fired on time whether or not a batch is forming or computing (Triton's
    fire only when the next batch forms): a task sleeps on the engine's clock until the earliest
    one; REJECT answers DEADLINE_EXCEEDED there and then, DELAY moves the request behind its level."""

    def __init__(self, queue: WaitQueue[Item], clock: Clock) -> None:
        self.queue, self._clock = queue, clock
        self.wakeup = asyncio.Event()  # the queue changed: the engine's loop looks again
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
            if (until := self.queue.next_timeout) == float("inf"):
                await self._sooner.wait()
            else:
                await self._clock.wait(self._sooner, until)
            self.apply(self._clock.now())

    def apply(self, now: float) -> None:
        """Apply the timeouts passed by `now` (also just before a batch is planned)."""
        if self.queue.next_timeout > now:
            return
        for item in self.queue.time_out(now):
            waited_ms = (now - item.enqueued) * 1e3
            message = f"queue timeout passed after {waited_ms:.1f} ms in the queue (priority level {item.level})"
            item.future.set_exception(DeadlineExceeded(message))
        self.wakeup.set()
