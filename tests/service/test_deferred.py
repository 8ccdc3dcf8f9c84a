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
