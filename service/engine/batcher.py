"""Dynamic batching of stateless requests on the batch engine: batches formed within
`max_queue_delay`, requests of different T right-padded into one (exact for causal attention),
the outputs sliced back per request. How a batch is planned and padded are the pure primitives
of `service.batching`; queueing, deadlines, failure isolation and reports are the engine's."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import numpy as np

from service.batch_engine import BatchEngine, Computed, Item, Timing
from service.batching import BatcherConfig, BatchEvent, Clock, Plan, form_at, merge, plan_batch, split
from service.numerics import all_finite
from service.scheduling import SchedulePolicy

if TYPE_CHECKING:
    from service.backends.base import Backend

__all__ = ["Answer", "Batcher", "RunBatch", "Timing"]

RunBatch = Callable[[np.ndarray], tuple[np.ndarray, "Backend"]]  # (B, T, C) -> ((B, T, C), the backend that ran it)
Answer = tuple[np.ndarray, Timing]


class Batcher(BatchEngine[np.ndarray, np.ndarray]):
    def __init__(
        self,
        config: BatcherConfig,
        run_batch: RunBatch,
        executor: Executor,
        on_batch: Callable[[BatchEvent], None] | None = None,
        in_flight: Callable[[], int] | None = None,
        clock: Clock | None = None,
        current_trace: Callable[[], object] | None = None,
        schedule: SchedulePolicy | None = None,
    ) -> None:
        self.config, self._run = config, run_batch
        super().__init__(executor, config.max_queue_size, on_batch, in_flight, clock, current_trace, schedule)

    async def submit(  # type: ignore[override]
        self, x: np.ndarray, deadline: float | None = None, priority: int = 0, timeout_s: float | None = None
    ) -> Answer:
        """Queue (B, T, C) at `priority` (0: the default level); resolve to ((B, T, C), Timing).
        Raises Overloaded at once when full."""
        return await super().submit(x, x.shape, deadline, priority, timeout_s)

    def plan(self, queue: Sequence[Item], now: float) -> Plan[Item]:
        return plan_batch(queue, self.config, now)

    def form_at(self, queue: Sequence[Item], more_may_come: bool) -> float:
        return form_at(queue, self.config, more_may_come)

    def compute(self, payloads: list[np.ndarray]) -> Computed:
        """The requests' (B_i, T_i, C) as one right-padded batch through `run_batch`; an output each."""
        began = time.perf_counter()
        batch = merge(payloads)  # (sum B, T_max, C)
        merged = time.perf_counter()
        y, backend = self._run(batch)
        ran = time.perf_counter()
        outputs = split(y, [(int(x.shape[0]), int(x.shape[1])) for x in payloads])
        finite = all_finite(y)  # once for the batch, here rather than per request on the event loop
        return Computed(outputs, backend.name, merged - began, time.perf_counter() - ran, finite)
