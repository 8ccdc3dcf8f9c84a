"""Whether this replica should take traffic, beyond being loaded: on the required device
(`--require-device`), and with that device not lost to a sticky error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from service.backends.base import Backend
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
            metrics.device_required.labels(required).set(1)

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
