"""Batches the decode steps of different sequences: a step that finds the runner idle runs at
once; steps that arrive while it computes run together next (no waiting for company: a step
is usually one token, and its client waits for it before sending the next)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from service.arrays import all_finite, not_finite
from service.batching import alone_and_small
from service.decode.control import SequenceControl
from service.decode.runner import StepInput
from service.decode.sequences import SequenceStore
from service.errors import DeviceLost, InvalidInput, StaleSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pending:
    step: StepInput
    future: asyncio.Future[np.ndarray]


class StepBatcher:
    def __init__(
        self,
        run: Callable[[Sequence[StepInput]], list[np.ndarray]],
        executor: Executor,
        max_rows: int,
        in_flight: Callable[[], int] | None = None,
        inline_max_mflop: float = 0.0,
    ) -> None:
        self._run, self._executor, self.max_rows = run, executor, max_rows
        self._in_flight = in_flight  # requests in the server; None: assume others
        self.inline_max_mflop = inline_max_mflop
        self._pending: deque[_Pending] = deque()
        self._task: asyncio.Task[None] | None = None
        self.batches: Counter[int] = Counter()  # executed batches by their number of steps (bounded by max_rows)

    async def submit(self, step: StepInput) -> np.ndarray:
        """y (B, t, C) of the step; the sequence's length advances only if the answer is taken."""
        if await alone_and_small(1, step.x.shape, self.inline_max_mflop, self._idle_and_alone):
            (y,) = self._run([step])  # the only request in the server: no future, task or hop
            self.batches[1] += 1
            return _commit(step, y)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._pending.append(_Pending(step, future))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain(), name="steps")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch = self._take()
            if batch:
                await self._execute(batch)

    def _take(self) -> list[_Pending]:
        """Live steps of at most max_rows rows (always at least one), oldest first."""
        batch: list[_Pending] = []
        rows = 0
        while self._pending:
            item = self._pending[0]
            if item.future.done():  # cancelled while waiting: never computed
                self._pending.popleft()
                continue
            B = item.step.x.shape[0]
            if batch and rows + B > self.max_rows:
                break
            batch.append(self._pending.popleft())
            rows += B
        return batch

    def _alone(self) -> bool:
        return not self._pending and self._in_flight is not None and self._in_flight() <= 1

    def _idle_and_alone(self) -> bool:
        return (self._task is None or self._task.done()) and self._alone()

    async def _execute(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        try:
            shape = batch[0].step.x.shape  # a lone small step runs on the loop, as a lone small batch does
            if await alone_and_small(len(batch), shape, self.inline_max_mflop, self._alone):
                ys = self._run([p.step for p in batch])
            else:
                ys = await loop.run_in_executor(self._executor, self._run, [p.step for p in batch])
        except Exception as exc:
            if len(batch) == 1 or isinstance(exc, DeviceLost):  # a lost device fails every step alike
                for item in batch:
                    _fail(item, exc)
                return
            for item in batch:  # isolate the culprit: one sequence's failure never fails the others
                await self._execute([item])
            return
        self.batches[len(batch)] += 1
        for item, y in zip(batch, ys, strict=True):
            _answer(item, y)


def _answer(item: _Pending, y: np.ndarray) -> None:
    """Commit the step and answer it; an abandoned step commits nothing."""
    if item.future.done():
        return
    try:
        item.future.set_result(_commit(item.step, y))
    except InvalidInput as exc:
        item.future.set_exception(exc)


def _commit(step: StepInput, y: np.ndarray) -> np.ndarray:
    """The sequence grows by the step's t tokens; a non-finite output commits nothing, so the
    sequence stays as it was."""
    if not all_finite(y):
        raise InvalidInput(
            "the output is not finite: the input's values overflow float32 inside attention; the step "
            "was not added to the sequence"
        )
    step.sequence.length += step.x.shape[1]
    return y


def _fail(item: _Pending, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


class Decoder:
    """Incremental decoding: live sequences and the batcher of their steps."""

    def __init__(self, sequences: SequenceStore, steps: StepBatcher, backend: str = "torch-cpu") -> None:
        self.sequences, self.steps = sequences, steps
        self.backend = backend  # what computes the steps, as responses name it
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

    async def step(self, control: SequenceControl, x: np.ndarray) -> tuple[np.ndarray, int]:
        """(B, t, C) new tokens of the sequence -> their (B, t, C) outputs and the tokens the
        sequence holds after them."""
        if not all_finite(x):  # refused before it touches the sequence's state
            raise InvalidInput(not_finite(x))
        sequence = self.sequences.open(control, int(x.shape[0]), int(x.shape[2]))
        async with sequence.lock:  # this sequence's steps one at a time, in arrival order
            _check_offset(control, sequence.length, self.sequences.where)
            self.sequences.check_room(sequence, int(x.shape[1]))
            y = await self.steps.submit(StepInput(sequence, x))
            self.sequences.touch(sequence)
            if control.end:
                self.sequences.end(sequence)
        return y, sequence.length


def _check_offset(control: SequenceControl, held: int, where: str) -> None:
    """A step computed against a state that is not the client's would be answered OK and wrong:
    when the client says how many tokens it believes are held, they must be the ones held."""
    if control.offset is not None and control.offset != held:
        raise StaleSequence(
            f"sequence {control.label()}: the request's sequence_offset is {control.offset} but {where} holds "
            f"{held} tokens of it; nothing was computed. Start it again with sequence_start and its whole prefix"
        )
