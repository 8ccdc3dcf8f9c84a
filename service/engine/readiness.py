"""Whether this replica should take traffic: its state (loading, ready, draining, failed), a
version loaded, on the required device (`--require-device`), and that device not lost to a
sticky error. `Lifecycle` is the one readiness every signal asks."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from service.backends.base import Backend
from service.engine.served import ModelIdentity
from service.engine.versions import Loaded, Versions
from service.errors import DeviceLost, NotReady
from service.metrics import Metrics

log = logging.getLogger(__name__)


class DeviceHealth:
    def __init__(self, required: str, metrics: Metrics) -> None:
        self.required = required  # "any" or a device prefix such as "cuda"
        self.lost = asyncio.Event()  # set on a sticky device error: the server stops and exits
        self.lost_reason = ""
        self.on_serving: Callable[[bool], None] | None = None  # the server's health follows
        if required != "any":
            metrics.serving.device_required.labels(required).set(1)

    def allows(self, active: Backend) -> bool:
        return not self.lost.is_set() and (self.required == "any" or active.device.startswith(self.required))

    def observe(self, error: BaseException | None) -> bool:
        """True when `error` (a batch's) newly loses the device."""
        if not isinstance(error, DeviceLost) or self.lost.is_set():
            return False
        log.critical("the device is lost (%s): not serving any more; exiting to be replaced", error)
        self.lost_reason = error.detail
        self.lost.set()
        return True

    def check(self) -> None:
        if self.lost.is_set():
            reason = self.lost_reason[:200]
            raise NotReady(f"this replica lost its device ({reason}) and is restarting; retry on another")

    def serving_changed(self, ok: bool) -> None:
        if self.on_serving is not None:
            self.on_serving(ok)


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """The server's state, and the versions it serves."""

    def __init__(self, identity: ModelIdentity, versions: Versions, device: DeviceHealth) -> None:
        self.identity, self.versions, self.device = identity, versions, device
        self.state = State.LOADING
        self.draining = asyncio.Event()  # set once draining began: open streams stop reading

    @property
    def loaded(self) -> Loaded:
        """The latest version serving."""
        latest = self.versions.latest()
        if latest is None:
            if self.state is State.LOADING:
                raise NotReady("the model is still loading; retry shortly")
            raise NotReady(f"no version of model {self.identity.name!r} is loaded; retry once one is")
        return latest

    def set_state(self, state: State) -> None:
        self.state = state

    def fail(self) -> None:
        self.state = State.FAILED

    def serving_ok(self) -> bool:
        """Ready for traffic: loaded, and on the required device (--require-device) if any. The one
        source of readiness: gRPC ServerReady and ModelReady, HTTP /v2/health/ready and the
        model's /ready, mha_ready and the health service all ask it."""
        latest = self.versions.latest()
        return self.state is State.READY and latest is not None and self.device.allows(latest.chain.active)

    def readiness(self) -> str:
        """Why the server is not ready ("" when it is), for the clients' messages."""
        if self.serving_ok():
            return ""
        if self.state is State.READY and (latest := self.versions.latest()) is not None:
            active = latest.chain.active
            return f"--require-device {self.device.required}, but {active.name} on {active.device} serves"
        if self.state is State.READY:
            return f"no version of model {self.identity.name!r} is loaded"
        return f"the model is not ready (state: {self.state.value})"

    def check_ready(self) -> None:
        self.device.check()
        if self.state is State.DRAINING:
            raise NotReady("the server is draining for shutdown; retry on another replica")
        if self.state is State.LOADING:
            raise NotReady("the model is still loading; retry shortly")
        if self.state is not State.READY:
            raise NotReady(f"the model is not ready (state: {self.state.value}); retry shortly")

    def start_draining(self, announce: bool = True) -> None:
        if self.state is not State.DRAINING:
            level = logging.INFO if announce else logging.DEBUG
            log.log(level, "draining: new requests are refused, in-flight requests finish")
            self.set_state(State.DRAINING)
            self.draining.set()
