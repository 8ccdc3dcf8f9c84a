"""Inference requests in the server: `count`, every one until its call closes (its answer
written), what a drain waits out; `uncomputed`, those whose answer is not computed yet, what the
batch engine asks (may more requests come to share a batch?). An answer waiting for a slow
reader is in the first and not in the second: it will never join a batch."""

from __future__ import annotations

import asyncio


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self.uncomputed = 0
        self._idle: list[asyncio.Future[None]] = []  # drains waiting for the count to reach 0

    def started(self) -> None:
        self.count += 1
        self.uncomputed += 1

    def computed(self) -> None:
        """A request's answer is computed (or it failed): it will not join a batch any more.
        Called at most once per request, before its `finished`."""
        self.uncomputed -= 1

    def finished(self, computed: bool = False) -> None:
        self.count -= 1
        if not computed:
            self.uncomputed -= 1
        if self.count == 0 and self._idle:  # a drain waits: rare, so a request pays one test for it
            for waiter in self._idle:
                if not waiter.done():
                    waiter.set_result(None)
            self._idle.clear()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no inference request is in the server; False if `timeout_s` passed first."""
        if self.count == 0:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return False
        finally:
            if waiter in self._idle:
                self._idle.remove(waiter)
        return True
