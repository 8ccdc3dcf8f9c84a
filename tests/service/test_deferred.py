"""Bookkeeping after the answer: it runs at the event loop's next turn, in order, in the context
(request id) of the request that left it, and never before the answering task has yielded."""

from __future__ import annotations

import asyncio
import contextvars

from service.deferred import after_answer

request = contextvars.ContextVar("request", default="")


def test_records_run_after_the_answering_task_yields_in_order_and_in_its_context() -> None:
    seen: list[tuple[str, str]] = []

    async def answer(name: str) -> None:
        request.set(name)
        after_answer(lambda what: seen.append((what, request.get())), f"{name}-counted")
        assert seen == []  # nothing of it ran while the answer was being made
        request.set("")  # the request's scope ends: the record keeps the context it was left in

    async def main() -> None:
        await asyncio.gather(answer("a"), answer("b"))
        await asyncio.sleep(0)

    asyncio.run(main())
    assert seen == [("a-counted", "a"), ("b-counted", "b")]


def test_without_an_event_loop_a_record_runs_at_once() -> None:
    seen: list[int] = []
    after_answer(seen.append, 1)
    assert seen == [1]


def test_a_record_that_fails_is_logged_and_the_others_still_run(caplog) -> None:
    seen: list[str] = []

    def broken() -> None:
        raise ValueError("a metric that cannot be observed")

    async def main() -> None:
        after_answer(seen.append, "before")
        after_answer(broken)
        after_answer(seen.append, "after")
        await asyncio.sleep(0)
        assert seen == ["before", "after"]
        after_answer(seen.append, "next turn")  # the loop still runs what is left later
        await asyncio.sleep(0)

    with caplog.at_level("ERROR", logger="service.deferred"):
        asyncio.run(main())
    assert seen == ["before", "after", "next turn"]
    assert "bookkeeping after an answer failed" in caplog.text and "a metric that cannot be observed" in caplog.text


def test_records_left_while_others_run_run_too() -> None:
    """A record that leaves another (a batch's, its span's) is not lost."""
    seen: list[str] = []

    async def main() -> None:
        after_answer(lambda: after_answer(seen.append, "left by a record"))
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert seen == ["left by a record"]


def test_a_loop_closed_with_records_waiting_does_not_hold_up_the_next_loops() -> None:
    """Tests and tools run several loops in turn in one thread: what one left unrun (it stopped
    first) must not keep the next one's records from being scheduled."""
    seen: list[str] = []

    first = asyncio.new_event_loop()

    def leave_and_stop() -> None:
        after_answer(seen.append, "left behind")
        first.stop()  # this turn is the last: the record's turn never comes

    try:
        first.call_soon(leave_and_stop)
        first.run_forever()
    finally:
        first.close()

    async def main() -> None:
        after_answer(seen.append, "next loop")
        await asyncio.sleep(0)

    asyncio.run(main())
    assert seen == ["next loop"]
