"""The door: the one interface between the wire (service/protocol/) and the model.

The wire decodes a request into numpy and calls the door; nothing of protocol/ reaches past it
into the core, its versions, batchers or metrics (tests/test_layers.py checks the imports). What
a request may ask of the model, all of it here:

    route       which entry and version a request goes to (readiness, the sequence entry's rules)
    infer/step  a stateless request through the batcher; a decode step of a live sequence
    hold        its bytes in the in-flight budget
    ready       readiness, and why not
    describe    metadata, config, the repository index, statistics
    settings    load and unload calls, trace settings
    calls       requests in flight, and closed calls into the statistics

The types its methods take and return are named here too, so that the wire imports one module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from service.budget import Lease
from service.decode.control import SequenceControl, SequenceId
from service.engine.core import InferenceCore
from service.engine.inflight import InFlight
from service.engine.served import ModelIdentity, ServedModel, Serving
from service.engine.sources import VersionPolicy
from service.engine.stats import Duration, ModelStats
from service.engine.versions import Loaded, VersionState
from service.errors import FeatureOff, InvalidInput, ModelNotFound, quote
from service.settings import Settings
from service.tracing import TraceValues

__all__ = [
    "Answer",
    "Door",
    "Duration",
    "InFlight",
    "Loaded",
    "ModelIdentity",
    "ModelStats",
    "ModelView",
    "SequenceControl",
    "SequenceId",
    "ServedModel",
    "Serving",
    "StepAnswer",
    "VersionPolicy",
]
T = TypeVar("T")
Queue = tuple[int, float | None]  # a request's (priority, queue timeout in seconds) under the schedule policy
MODEL_CONTROL_OFF = (
    "model control is off: this server serves the versions it found at start (--model-control-mode none); "
    "start it with --model-control-mode explicit to load and unload on request, or poll to follow the repository"
)
MODEL_CONTROL_POLLED = (
    "this server follows its repository (--model-control-mode poll): change the repository and the next poll "
    "loads it; load and unload calls are for --model-control-mode explicit"
)


Answer = tuple[np.ndarray, str]  # (B, T, C) and the backend that computed it
StepAnswer = tuple[np.ndarray, str, dict[str, int | str]]  # ... and the sequence's length and home


@dataclass(frozen=True, slots=True)
class ModelView:
    """What metadata and config calls describe of one version."""

    entry: str
    model: ServedModel
    serving: Serving
    policy: VersionPolicy
    versions: list[str]  # every version serving


class Door:
    def __init__(self, core: InferenceCore, others_ready: Callable[[], bool] | None = None) -> None:
        """`others_ready`: whether every other part this server answers for can take every
        request (with --workers, every other worker: the app passes that in); None: there is none."""
        self._core = core
        self._others_ready = others_ready
        # The calls every request makes, bound once: the door adds no call of its own to them.
        self.entry: Callable[[str], str] = core.identity.check  # the entry a name names; NOT_FOUND else
        self.hold: Callable[..., Lease] = core.budget.take  # (nbytes, what): bytes in flight until released
        self.now: Callable[[], float] = core.clock.now  # the clock request deadlines are given on

    @property
    def settings(self) -> Settings:
        return self._core.settings

    @property
    def draining(self) -> asyncio.Event:
        """Set once draining began: open streams stop reading."""
        return self._core.draining

    def ready(self) -> bool:
        """The one readiness every signal answers: ServerReady, ModelReady, HTTP ready."""
        return self._core.serving_ok() and (self._others_ready is None or self._others_ready())

    def why_not_ready(self) -> str:
        if (why := self._core.readiness()) or self.ready():
            return why
        return "the other workers of this replica are still loading; retry shortly"

    def route(self, entry: str, version: str, control: SequenceControl | None) -> Loaded:
        """The version a request to `entry` (as `entry()` returned it) goes to, ready to take it;
        a sequence's later steps to the version it began on."""
        identity = self._core.identity
        if control is None and identity.is_sequence_model(entry):
            raise InvalidInput(
                f"model {entry!r} takes the steps of sequences: send sequence_id (with sequence_start on the first "
                f"step), or send whole sequences to model {identity.name!r}"
            )
        return self._core.route(control, version)

    async def infer(
        self, version: Loaded, x: np.ndarray, deadline: float | None, queue: Queue, request_id: str
    ) -> Answer:
        """(B, T, C) -> (B, T, C); `deadline` on `now()`'s clock."""
        y, timing = await self._core.infer(x, deadline, version, queue, request_id)
        return y, timing.backend

    async def step(
        self, version: Loaded, control: SequenceControl, x: np.ndarray, deadline: float | None
    ) -> StepAnswer:
        y, timing, length = await self._core.step(control, x, version, deadline)
        return y, timing.backend, {"sequence_length": length, **self._core.location}

    def model_ready(self, name: str, version: str) -> bool:
        """The server serves, and the version named (or any) takes requests; a model or version
        that is not loaded is not ready (Triton answers so, not NOT_FOUND)."""
        core = self._core
        if name not in core.identity.names:
            return False
        if not version:
            return self.ready()
        loaded = core.versions.get(version)
        return self.ready() and loaded is not None and loaded.state is VersionState.SERVING

    def describe(self, name: str, version: str) -> ModelView:
        core = self._core
        entry, loaded = core.identity.check(name), core.versions.for_request(version)
        serving = [v.version for v in core.versions.serving()]
        return ModelView(entry, loaded.model, core.serving(loaded), core.loader.policy, serving)

    def index(self) -> tuple[ModelIdentity, list[tuple[str, str]], str]:
        """The entries, each version loaded with its state, and why the server is not ready ("")."""
        versions = [(loaded.version, loaded.state.value) for loaded in self._core.versions]
        return self._core.identity, versions, self.why_not_ready()

    def statistics(self, name: str, version: str, render: Callable[[str, str, ModelStats], T]) -> list[T]:
        """Each entry's (`name`'s, or every one's) statistics in the version named or in every
        version loaded, rendered by `render(entry, version, stats)` while they are held still."""
        core = self._core
        names = [core.identity.check(name)] if name else list(core.identity.names)
        versions = [core.versions.for_request(version).version] if version else [v.version for v in core.versions]
        rendered = []
        for entry in names:
            for number in versions or [""]:
                with core.publish.statistics(number, steps=core.identity.is_sequence_model(entry)) as held:
                    rendered.append(render(entry, number, held))
        return rendered

    async def load(self, name: str) -> None:
        """Load what the repository names now (explicit mode): new versions beside the serving ones."""
        self._controlled(name)
        await self._core.keeper.load_call()

    async def unload(self, name: str) -> None:
        self._controlled(name)
        await self._core.keeper.unload_call()

    def _controlled(self, name: str) -> None:
        """Load and unload calls: only in explicit mode, and only for this server's model."""
        mode = self._core.settings.model_control_mode
        if mode == "none":
            raise FeatureOff(MODEL_CONTROL_OFF)
        if mode == "poll":
            raise FeatureOff(MODEL_CONTROL_POLLED)
        if name not in self._core.identity.names:
            raise ModelNotFound(f"unknown model {quote(name)}; this server serves {self._core.identity.name!r}")

    def trace_settings(self, changes: Mapping[str, list[str] | None]) -> TraceValues:
        """Triton's trace settings, changed by `changes` (empty: read), as they are now."""
        control = self._core.tracing.control
        return control.change(changes) if changes else control.settings()

    @property
    def requests(self) -> InFlight:
        """The inference requests in the server: each call opens and closes its own count."""
        return self._core.requests

    def requests_closed(self, records: Iterable[tuple[str, bool, str, float]]) -> None:
        """Closed inference calls (version, step, status code's name, seconds) into their
        version's statistics (a request refused before it reached a version: the latest's)."""
        latest = self._core.versions.latest()
        self._core.publish.requests_closed(records, latest.version if latest is not None else "")
