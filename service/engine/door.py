"""The door: the one interface between the wire (service/protocol/) and the model.

The wire decodes a request into numpy and calls the door; nothing of protocol/ reaches past it
into the core, its versions, batchers or metrics (tests/test_layers.py checks the imports). What
a request may ask of the model, all of it here:

    route       which entry and version a request goes to (readiness, the sequence entry's rules)
    infer/step  a stateless request through its version's batcher; a decode step of a live
                sequence through its version's decoder: the numerics policy's bound before,
                the answer's finiteness after, reported, and (sampled) audited
    hold        its bytes in the in-flight budget
    ready       readiness, and why not
    describe    metadata, config, the repository index, statistics
    settings    load and unload calls, trace settings
    calls       requests in flight, and closed calls into the statistics
    distrust    another worker's audit verdict on a backend this worker shares, taken as its own

The types its methods take and return are named here too, so that the wire imports one module.

`Batcher` is what `infer` goes through: dynamic batching of a version's stateless requests on
the batch engine (batches formed within `max_queue_delay`, requests of different T right-padded
into one, exact for causal attention, the outputs sliced back per request). How a batch is
planned and padded are the pure primitives of `service.batching`; queueing, deadlines, failure
isolation and reports are `service.batch_engine`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from service.batch_engine import BatchEngine, Computed, Item, Timing
from service.batching import BatcherConfig, BatchEvent, Clock, Plan, form_at, merge, plan_batch, split
from service.budget import InflightBudget, Lease
from service.decode.control import SequenceControl, SequenceId
from service.engine.inflight import InFlight
from service.engine.publishing import Publisher
from service.engine.readiness import Lifecycle
from service.engine.served import ModelIdentity, ServedModel, Serving
from service.engine.sources import VersionPolicy
from service.engine.stats import Duration, ModelStats
from service.engine.versions import Loaded, VersionState
from service.errors import DeviceLost, FeatureOff, InvalidInput
from service.numerics import all_finite, refuse_non_finite
from service.scheduling import SchedulePolicy
from service.settings import Settings
from service.tracing import TraceValues

if TYPE_CHECKING:
    from service.backends.base import Backend
    from service.engine.audit import Audit
    from service.engine.keeper import VersionKeeper

__all__ = [
    "Answer",
    "Batched",
    "Batcher",
    "Door",
    "Duration",
    "InFlight",
    "Loaded",
    "ModelIdentity",
    "ModelStats",
    "ModelView",
    "RunBatch",
    "SequenceControl",
    "SequenceId",
    "ServedModel",
    "Serving",
    "StepAnswer",
    "Timing",
    "Verdict",
    "VersionPolicy",
]
T = TypeVar("T")
Queue = tuple[int, float | None]  # a request's (priority, queue timeout in seconds) under the schedule policy
NO_STEPS = (
    "no backend of this server computes decode steps: its model directory has no step graphs and PyTorch is not "
    "among --backend's; re-export the model with `mha export`, or send whole sequences"
)


Answer = tuple[np.ndarray, str]  # (B, T, C) and the backend that computed it
StepAnswer = tuple[np.ndarray, str, dict[str, int | str]]  # ... and the sequence's length and home
RunBatch = Callable[[np.ndarray], tuple[np.ndarray, "Backend"]]  # (B, T, C) -> ((B, T, C), the backend that ran it)
Batched = tuple[np.ndarray, Timing]  # a batched request's (B, T, C) and how its batch went


@dataclass(frozen=True, slots=True)
class Verdict:
    """Another worker's audit found `backend` of `version` computing wrongly on `device`."""

    version: str
    backend: str
    device: str
    by: str  # who found it: "worker 0"
    times: int  # the how-many-th time it was found so (the first: 1)
    ago_s: float  # how long ago


Distrust = Callable[[Verdict], None]  # another worker's verdict, taken as this worker's own


@dataclass(frozen=True, slots=True)
class ModelView:
    """What metadata and config calls describe of one version."""

    entry: str
    model: ServedModel
    serving: Serving
    policy: VersionPolicy
    versions: list[str]  # every version serving


class Door:
    def __init__(
        self,
        life: Lifecycle,
        keeper: VersionKeeper,
        publish: Publisher,
        audit: Audit,
        budget: InflightBudget,
        distrust: Distrust,
        others_ready: Callable[[], bool] | None = None,
    ) -> None:
        """`others_ready`: whether every other part this server answers for can take every
        request (with --workers, every other worker: the app passes that in); None: there is none."""
        self._life, self._keeper, self._publish, self._audit = life, keeper, publish, audit
        self._others_ready = others_ready
        self.distrust = distrust  # another worker's audit verdict, as its own
        self.hold: Callable[..., Lease] = budget.take  # (nbytes, what): bytes in flight until released
        self.now: Callable[[], float] = keeper.compute.clock.now  # the clock request deadlines are given on

    @property
    def settings(self) -> Settings:
        return self._keeper.settings

    @property
    def draining(self) -> asyncio.Event:
        """Set once draining began: open streams stop reading."""
        return self._life.draining

    def entry(self, name: str) -> str:
        """The entry a request's model name names; NOT_FOUND else."""
        return self._life.identity.check(name)

    def ready(self) -> bool:
        """The one readiness every signal answers: ServerReady, ModelReady, HTTP ready."""
        return self._life.serving_ok() and (self._others_ready is None or self._others_ready())

    def why_not_ready(self) -> str:
        if (why := self._life.readiness()) or self.ready():
            return why
        return "the other workers of this replica are still loading; retry shortly"

    def route(self, entry: str, version: str, control: SequenceControl | None) -> Loaded:
        """The version a request to `entry` (as `entry()` returned it) goes to, ready to take it: the
        one it names, else the latest; a sequence's later steps to the version it began on."""
        life = self._life
        if control is None and life.identity.is_sequence_model(entry):
            raise InvalidInput(
                f"model {entry!r} takes the steps of sequences: send sequence_id (with sequence_start on the first "
                f"step), or send whole sequences to model {life.identity.name!r}"
            )
        life.check_ready()
        return life.versions.for_request(version) if control is None else life.versions.for_step(control, version)

    async def infer(
        self, version: Loaded, x: np.ndarray, deadline: float | None, queue: Queue, request_id: str
    ) -> Answer:
        """(B, T, C) -> (B, T, C) through `version`'s queue; `deadline` on `now()`'s clock; `queue`
        the request's (priority, timeout in seconds) under the schedule policy."""
        version.model.check_magnitude(x)
        y, timing = await version.batcher.submit(x, deadline, *queue)
        if not timing.finite:  # the chain found this input to blame (BackendChain)
            refuse_non_finite(x, y)
        self._publish.answered(x.shape, timing, version.version)
        await self._audit.answered(x, y, timing.backend, request_id, version)  # sampled, or checked before it goes
        return y, timing.backend

    async def step(
        self, version: Loaded, control: SequenceControl, x: np.ndarray, deadline: float | None, request_id: str
    ) -> StepAnswer:
        """A decode step of a live sequence: (B, t, C) new tokens -> their (B, t, C) outputs, the
        backend, and the tokens the sequence holds after the step and where it lives."""
        if version.chain.steps_device is None:
            raise FeatureOff(NO_STEPS)
        version.model.check_magnitude(x)  # the cached keys and values were checked with their own steps
        try:
            with self._keeper.compute.tracing.step(control.label, int(x.shape[1])) as span:
                stepped = await version.decoder.step(control, x, deadline)
                if span is not None:
                    span.set_attribute("mha.sequence.tokens_held", stepped.length)
        except DeviceLost as exc:  # the caches' device is gone: stop serving, as a lost batch does
            if self._life.device.observe(exc):
                self._life.fail()
            raise
        self._publish.answered(x.shape, stepped.timing, version.version, steps=True)
        backend = stepped.timing.backend
        await self._audit.answered_step(x, stepped.y, stepped.sequence, backend, request_id, version)  # as infer's
        s = self.settings
        return (
            stepped.y,
            backend,
            {"sequence_length": stepped.length, "replica": s.replica, "worker": s.worker_index},
        )

    def model_ready(self, name: str, version: str) -> bool:
        """The server serves, and the version named (or any) takes requests; a model or version
        that is not loaded is not ready (Triton answers so, not NOT_FOUND)."""
        if name not in self._life.identity.names:
            return False
        if not version:
            return self.ready()
        loaded = self._life.versions.get(version)
        return self.ready() and loaded is not None and loaded.state is VersionState.SERVING

    def describe(self, name: str, version: str) -> ModelView:
        life = self._life
        entry, loaded = life.identity.check(name), life.versions.for_request(version)
        serving = [v.version for v in life.versions.serving()]
        return ModelView(entry, loaded.model, self._keeper.serving(loaded), self._keeper.policy, serving)

    def index(self) -> tuple[ModelIdentity, list[tuple[str, str]], str]:
        """The entries, each version loaded with its state, and why the server is not ready ("")."""
        versions = [(loaded.version, loaded.state.value) for loaded in self._life.versions]
        return self._life.identity, versions, self.why_not_ready()

    def statistics(self, name: str, version: str, render: Callable[[str, str, ModelStats], T]) -> list[T]:
        """Each entry's (`name`'s, or every one's) statistics in the version named or in every
        version loaded, rendered by `render(entry, version, stats)` while they are held still."""
        identity, versions = self._life.identity, self._life.versions
        names = [identity.check(name)] if name else list(identity.names)
        numbers = [versions.for_request(version).version] if version else [v.version for v in versions]
        rendered = []
        for entry in names:
            for number in numbers or [""]:
                with self._publish.statistics(number, steps=identity.is_sequence_model(entry)) as held:
                    rendered.append(render(entry, number, held))
        return rendered

    async def load(self, name: str) -> None:
        """Load what the repository names now (explicit mode): new versions beside the serving ones."""
        await self._keeper.load_call(name)

    async def unload(self, name: str) -> None:
        await self._keeper.unload_call(name)

    def trace_settings(self, changes: Mapping[str, list[str] | None]) -> TraceValues:
        """Triton's trace settings, changed by `changes` (empty: read), as they are now."""
        control = self._keeper.compute.tracing.control
        return control.change(changes) if changes else control.settings()

    @property
    def requests(self) -> InFlight:
        """The inference requests in the server: each call opens and closes its own count."""
        return self._keeper.compute.requests

    def requests_closed(self, records: Iterable[tuple[str, bool, str, float]]) -> None:
        """Closed inference calls (version, step, status code's name, seconds) into their
        version's statistics (a request refused before it reached a version: the latest's)."""
        latest = self._life.versions.latest()
        self._publish.requests_closed(records, latest.version if latest is not None else "")


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
    ) -> Batched:
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
