"""Inference requests in the server, queued or computing: what the batchers ask ("is this
request alone?") and what a drain waits out."""

from __future__ import annotations

import asyncio


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()  # set while count is 0
        self._idle.set()

    def started(self) -> None:
        self.count += 1
        self._idle.clear()

    def finished(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no inference request is in the server; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
