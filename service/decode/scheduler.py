"""Batches the decode steps of different sequences on the batch engine: steps that arrive while a
batch computes run together next (no waiting for company: a step is usually one token, and its
client waits for it before sending the next); a step commits to its sequence only when its
answer is delivered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from service.backends.base import Backend, Step
from service.batch_engine import BatchEngine, Computed, Item, Timing
from service.batching import BatchEvent, Clock, Plan, plan_steps
from service.decode.control import SequenceControl
from service.decode.sequences import LiveSequence, SequenceStore
from service.errors import StaleSequence
from service.numerics import refuse_non_finite, refuse_non_finite_input

log = logging.getLogger(__name__)


StepInput = Step[LiveSequence]  # a step of a live sequence: its cache is the sequence


RunSteps = Callable[[Sequence[StepInput]], tuple[list[np.ndarray], Backend]]  # -> (y of each step, backend)


@dataclass(frozen=True)
class Stepped:
    """What a step's caller learns."""

    y: np.ndarray  # (B, t, C): the outputs of the step's tokens
    length: int  # tokens the sequence holds after the step
    timing: Timing  # its time in the queue, the backend that computed it, its batch's compute
    sequence: LiveSequence  # its keys and values (the audit reads them)


class StepBatcher(BatchEngine[StepInput, np.ndarray]):
    def __init__(
        self,
        run: RunSteps,
        executor: Executor,
        max_rows: int,
        max_queue_size: int = 256,
        in_flight: Callable[[], int] | None = None,
        on_batch: Callable[[BatchEvent], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.max_rows, self._run = max_rows, run
        super().__init__(executor, max_queue_size, on_batch=on_batch, in_flight=in_flight, clock=clock)

    async def submit(self, step: StepInput, deadline: float | None = None) -> tuple[np.ndarray, Timing]:  # type: ignore[override]
        """y (B, t, C) of the step and its Timing; the sequence's length advances only if the
        answer is taken. A step whose `deadline` (clock time) passes before it computes is
        answered DEADLINE_EXCEEDED and never computed."""
        return await super().submit(step, step.x.shape, deadline)

    def plan(self, queue: Sequence[Item], now: float) -> Plan[Item]:
        return plan_steps(queue, self.max_rows, now)

    def form_at(self, queue: Sequence[Item], more_may_come: bool) -> float:
        """Steps do not wait for company: each one's client waits for it before sending the next."""
        return -float("inf")

    def compute(self, payloads: list[StepInput]) -> Computed:
        ys, backend = self._run(payloads)  # the backend reads and writes the caches itself: all of it is inference
        for step in payloads:  # an audit that finds `backend` wrong drops what it wrote
            step.cache.writers.add(backend.name)
        return Computed(ys, backend.name)

    def deliver(self, payload: StepInput, output: np.ndarray) -> np.ndarray:
        """The sequence grows by the step's t tokens; a non-finite output commits nothing, so the
        sequence stays as it was. NaN or inf in the step's input always reach its output (as on the
        stateless path), so they are found here, and named, without a pass over every input."""
        refuse_non_finite(payload.x, output, then="the step was not added to the sequence")
        payload.cache.length += payload.x.shape[1]
        return output


class Decoder:
    """Incremental decoding: live sequences and the batcher of their steps."""

    def __init__(self, sequences: SequenceStore, steps: StepBatcher, require_offset: bool = False) -> None:
        self.sequences, self.steps = sequences, steps
        self.require_offset = require_offset  # --require-sequence-offset
        self._expiry: asyncio.Task[None] | None = None

    def start(self, expiry_period_s: float) -> None:
        """Evict idle sequences even when no step arrives, so that their memory and gauges follow."""

        async def expire() -> None:
            while True:
                await asyncio.sleep(expiry_period_s)
                self.sequences.expire_idle()

        self._expiry = asyncio.get_running_loop().create_task(expire(), name="sequence-expiry")
        self.steps.start()

    async def close(self) -> None:
        """Finish the steps already queued; live sequences are lost with the process (clients
        restart them elsewhere with their prefix)."""
        if self._expiry is not None:
            self._expiry.cancel()
        await self.steps.stop()
        self.sequences.drop("was dropped at shutdown")

    async def step(self, control: SequenceControl, x: np.ndarray, deadline: float | None = None) -> Stepped:
        """(B, t, C) new tokens of the sequence -> their (B, t, C) outputs, the tokens the sequence
        holds after them, and the step's time in the queue."""
        if control.start:  # a start would drop the sequence's state: refused first
            refuse_non_finite_input(x)  # (any other step's NaN or inf is found in its output)
        if self.require_offset and not control.start and control.offset is None:
            raise StaleSequence(
                f"sequence {control.label()}: this server requires sequence_offset on every step after the first "
                "(--require-sequence-offset: several replicas serve, and a step without it could be computed "
                "against a state that is not yours); send the number of tokens sent before this step as the "
                "request parameter sequence_offset"
            )
        sequence = self.sequences.open(control, int(x.shape[0]), int(x.shape[2]))
        async with sequence.lock:  # this sequence's steps one at a time, in arrival order
            _check_offset(control, sequence.length, self.sequences.home.label)
            self.sequences.check_room(sequence, int(x.shape[1]))
            y, timing = await self.steps.submit(StepInput(sequence, x), deadline)
            self.sequences.touch(sequence)
            if control.end:
                self.sequences.end(sequence)
        return Stepped(y, sequence.length, timing, sequence)


def _check_offset(control: SequenceControl, held: int, where: str) -> None:
    """A step computed against a state that is not the client's would be answered OK and wrong:
    when the client says how many tokens it believes are held, they must be the ones held."""
    if control.offset is not None and control.offset != held:
        raise StaleSequence(
            f"sequence {control.label()}: the request's sequence_offset is {control.offset} but {where} holds "
            f"{held} tokens of it; nothing was computed. Start it again with sequence_start and its whole prefix"
        )
