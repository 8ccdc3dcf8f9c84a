"""The in-flight count a drain waits out: it returns as soon as the last request finishes, and
not before; on its timeout it says so; every drain waiting is woken."""

from __future__ import annotations

import asyncio

from service.engine.inflight import InFlight


def test_a_drain_returns_when_the_last_request_finishes_and_not_before() -> None:
    async def scenario() -> None:
        requests = InFlight()
        assert await requests.wait_idle(0.0)  # nothing in flight: at once, even with no time
        requests.started()
        requests.started()
        drains = [asyncio.ensure_future(requests.wait_idle(60.0)) for _ in range(2)]
        await asyncio.sleep(0)
        requests.finished()
        for _ in range(10):  # turns enough for a woken drain to return
            await asyncio.sleep(0)
        assert not any(d.done() for d in drains)  # one request still in the server
        requests.finished()
        assert await asyncio.gather(*drains) == [True, True]
        assert requests.count == 0

    asyncio.run(scenario())


def test_a_drain_that_times_out_says_so_and_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        requests = InFlight()
        requests.started()
        assert not await requests.wait_idle(0.0)
        requests.finished()  # no waiter left to wake
        requests.started()
        waiting = asyncio.ensure_future(requests.wait_idle(60.0))
        await asyncio.sleep(0)
        requests.finished()
        assert await waiting

    asyncio.run(scenario())
