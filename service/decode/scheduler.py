"""Batches the decode steps of different sequences: a step that finds none computing runs at
once; steps that arrive while a batch computes run together next (no waiting for company: a step
is usually one token, and its client waits for it before sending the next)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial

import numpy as np

from service.arrays import all_finite, not_finite
from service.batching import BatchEvent, Clock, InlineGate, MonotonicClock, Pending, batch_event, run_each_alone
from service.decode.control import SequenceControl
from service.decode.sequences import Sequence as LiveSequence
from service.decode.sequences import SequenceStore
from service.errors import DeadlineExceeded, DeviceLost, InvalidInput, StaleSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInput:
    sequence: LiveSequence
    x: np.ndarray  # (B, t, C): the new tokens of each of the sequence's B rows


Computed = tuple[np.ndarray, float, str]  # y, when its compute began, the backend that computed it
Step = Pending[StepInput, Computed]  # a step waiting for its batch
RunSteps = Callable[[Sequence[StepInput]], tuple[list[np.ndarray], str]]  # -> (y of each step, backend)


@dataclass(frozen=True)
class Stepped:
    """What a step's caller learns."""

    y: np.ndarray  # (B, t, C): the outputs of the step's tokens
    length: int  # tokens the sequence holds after the step
    queue_s: float  # submitted -> its batch began computing
    backend: str  # what computed it


class StepBatcher:
    def __init__(
        self,
        run: RunSteps,
        executor: Executor,
        max_rows: int,
        in_flight: Callable[[], int] | None = None,
        inline_max_mflop: float = 0.0,
        on_batch: Callable[[BatchEvent], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._run, self._executor, self.max_rows = run, executor, max_rows
        self._gate = InlineGate(in_flight, inline_max_mflop)
        self._on_batch = on_batch  # each executed batch, for metrics and statistics
        self.clock: Clock = clock or MonotonicClock()
        self._pending: deque[Step] = deque()
        self._task: asyncio.Task[None] | None = None
        self._events: deque[BatchEvent] = deque()  # reported by the worker thread, published on the loop

    async def submit(self, step: StepInput, deadline: float | None = None) -> tuple[np.ndarray, float, str]:
        """y (B, t, C) of the step, its time in the queue and the backend that computed it; the
        sequence's length advances only if the answer is taken. A step whose `deadline` (clock
        time) passes before it computes is answered DEADLINE_EXCEEDED and never computed."""
        enqueued = self.clock.now()
        if self._gate.inline(1, step.x.shape, len(self._pending)):
            _check_deadline(deadline, enqueued, self.clock.now())
            try:
                (y,), started, backend = self._compute([step], enqueued)  # the only request in the server
            finally:
                self._publish()
            return _commit(step, y), started - enqueued, backend
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Computed] = loop.create_future()
        self._pending.append(Pending(step, step.x.shape, future, enqueued, deadline))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain(), name="steps")
        y, started, backend = await future
        return y, started - enqueued, backend

    async def _drain(self) -> None:
        while self._pending:
            batch = self._take()
            if batch:
                await self._execute(batch)

    def _take(self) -> list[Step]:
        """Live steps of at most max_rows rows (always at least one), oldest first."""
        batch: list[Step] = []
        rows = 0
        while self._pending:
            item = self._pending[0]
            if item.gone:  # cancelled while waiting: never computed
                self._pending.popleft()
                continue
            if item.deadline is not None and item.deadline <= (now := self.clock.now()):
                _fail(self._pending.popleft(), DeadlineExceeded(_waited(item.enqueued, now)))
                continue
            if batch and rows + item.rows > self.max_rows:
                break
            batch.append(self._pending.popleft())
            rows += item.rows
        return batch

    async def _execute(self, batch: list[Step]) -> None:
        steps, oldest = [p.payload for p in batch], batch[0].enqueued
        try:
            if self._gate.inline(len(batch), _covered_shape(batch), len(self._pending)):
                ys, started, backend = self._compute(steps, oldest)  # alone and small: on the loop
            else:
                compute = partial(self._compute, steps, oldest)
                self._gate.computing = True
                try:
                    ys, started, backend = await asyncio.get_running_loop().run_in_executor(self._executor, compute)
                finally:
                    self._gate.computing = False
        except Exception as exc:
            self._publish()
            if len(batch) == 1 or isinstance(exc, DeviceLost):  # a lost device fails every step alike
                for item in batch:
                    _fail(item, exc)
                return
            await run_each_alone(batch, self._execute)  # one sequence's failure never fails the others
            return
        self._publish()
        for item, y in zip(batch, ys, strict=True):
            _answer(item, y, started, backend)

    def _compute(self, steps: list[StepInput], oldest: float) -> tuple[list[np.ndarray], float, str]:
        """Run the steps, reporting the batch (on a worker thread, or on the loop when alone): their
        outputs, and when the compute began."""
        shapes = [(int(s.x.shape[0]), int(s.x.shape[1])) for s in steps]
        started = self.clock.now()
        error: BaseException | None = None
        backend = ""
        try:
            ys, backend = self._run(steps)
            return ys, started, backend
        except Exception as exc:
            error = exc
            raise
        finally:
            if self._on_batch is not None:
                self._events.append(batch_event(shapes, (oldest, started), self.clock.now(), backend, error))

    def _publish(self) -> None:
        """The executed batches' events, to metrics and statistics, on the event loop's thread."""
        while self._events and self._on_batch is not None:
            self._on_batch(self._events.popleft())


def _answer(item: Step, y: np.ndarray, started: float, backend: str) -> None:
    """Commit the step and answer it; an abandoned step commits nothing."""
    if item.future.done():
        return
    try:
        item.future.set_result((_commit(item.payload, y), started, backend))
    except InvalidInput as exc:
        item.future.set_exception(exc)


def _commit(step: StepInput, y: np.ndarray) -> np.ndarray:
    """The sequence grows by the step's t tokens; a non-finite output commits nothing, so the
    sequence stays as it was. NaN or inf in the step's input always reach its output (as on the
    stateless path), so they are found here, and named, without a pass over every input."""
    if not all_finite(y):
        raise InvalidInput(f"{not_finite(step.x)}; the step was not added to the sequence")
    step.sequence.length += step.x.shape[1]
    return y


def _waited(enqueued: float, now: float) -> str:
    return f"deadline passed after {(now - enqueued) * 1e3:.1f} ms waiting for the step's turn"


def _check_deadline(deadline: float | None, enqueued: float, now: float) -> None:
    if deadline is not None and deadline <= now:
        raise DeadlineExceeded(_waited(enqueued, now))


def _covered_shape(batch: list[Step]) -> tuple[int, int, int]:
    """(rows, t, C) a batch of steps covers: its rows, its longest step and the width, the shape
    whose work `InlineGate` weighs."""
    return sum(p.rows for p in batch), max(p.seq for p in batch), int(batch[0].shape[2])


def _fail(item: Step, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


class Decoder:
    """Incremental decoding: live sequences and the batcher of their steps."""

    def __init__(self, sequences: SequenceStore, steps: StepBatcher) -> None:
        self.sequences, self.steps = sequences, steps
        self._expiry: asyncio.Task[None] | None = None

    def start(self, expiry_period_s: float) -> None:
        """Evict idle sequences even when no step arrives, so that their memory and gauges follow."""

        async def expire() -> None:
            while True:
                await asyncio.sleep(expiry_period_s)
                self.sequences.expire_idle()

        self._expiry = asyncio.get_running_loop().create_task(expire(), name="sequence-expiry")

    def close(self) -> None:
        """Live sequences are lost with the process (clients restart them elsewhere with their prefix)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self.sequences.clear()

    async def step(self, control: SequenceControl, x: np.ndarray, deadline: float | None = None) -> Stepped:
        """(B, t, C) new tokens of the sequence -> their (B, t, C) outputs, the tokens the sequence
        holds after them, and the step's time in the queue."""
        if control.start and not all_finite(x):  # a start would drop the sequence's state: refused first
            raise InvalidInput(not_finite(x))  # (any other step's NaN or inf is found in its output)
        sequence = self.sequences.open(control, int(x.shape[0]), int(x.shape[2]))
        async with sequence.lock:  # this sequence's steps one at a time, in arrival order
            _check_offset(control, sequence.length, self.sequences.where)
            self.sequences.check_room(sequence, int(x.shape[1]))
            y, queue_s, backend = await self.steps.submit(StepInput(sequence, x), deadline)
            self.sequences.touch(sequence)
            if control.end:
                self.sequences.end(sequence)
        return Stepped(y, sequence.length, queue_s, backend)


def _check_offset(control: SequenceControl, held: int, where: str) -> None:
    """A step computed against a state that is not the client's would be answered OK and wrong:
    when the client says how many tokens it believes are held, they must be the ones held."""
    if control.offset is not None and control.offset != held:
        raise StaleSequence(
            f"sequence {control.label()}: the request's sequence_offset is {control.offset} but {where} holds "
            f"{held} tokens of it; nothing was computed. Start it again with sequence_start and its whole prefix"
        )
