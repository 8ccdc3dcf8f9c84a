"""The test helpers' own promises, where a broken helper would make other tests hang or pass."""

from __future__ import annotations

import asyncio
import threading

from tests.support import held_until


def test_held_until_holds_the_first_worker_call_and_never_the_event_loop() -> None:
    asked: list[str] = []
    ran: list[int] = []

    def ready() -> bool:
        asked.append(threading.current_thread().name)
        return True

    held = held_until(ran.append, ready, timeout_s=5.0)

    async def lone_request_computed_in_line() -> None:
        held(1)  # a request alone in the server, computed on the loop: holding it would hold the loop

    asyncio.run(lone_request_computed_in_line())
    assert asked == [] and ran == [1]
    worker = threading.Thread(target=held, args=(2,), name="infer_0")
    worker.start()
    worker.join()
    held(3)
    assert asked == ["infer_0"], "only the first call off the loop waits for ready()"
    assert ran == [1, 2, 3]
