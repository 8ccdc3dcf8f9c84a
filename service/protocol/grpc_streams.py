"""Answering a stream of requests concurrently, with nothing left running when it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_END = object()


async def answer_concurrently(
    requests: AsyncIterator[Req],
    answer: Callable[[Req], Awaitable[Resp]],
    stop: tuple[asyncio.Event, Exception] | None = None,
) -> AsyncIterator[Resp]:
    """Answer each request on its own task and yield the answers as they complete.

    Requests of one stream may so share batches. Whenever the consumer stops, because the
    requests ended and all were answered, the client cancelled, the deadline passed or the
    stream was closed, the reader and every unanswered request are cancelled and awaited:
    nothing keeps computing for a client that has gone. An error reading the requests is
    raised once the requests read before it are answered. `stop` = (event, error): once the
    event is set, reading stops and, after the answers to what was read, `error` is raised.
    """
    answers: asyncio.Queue[object] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    async def one(request: Req) -> None:
        await answers.put(await answer(request))

    async def read() -> None:
        try:
            async for request in requests:
                task = asyncio.create_task(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:  # on a read error too: what was read is answered first
            if tasks:
                await asyncio.wait(tasks)
            await answers.put(_END)

    reader = asyncio.create_task(read())
    stopper = asyncio.create_task(stop[0].wait()) if stop else None
    if stopper is not None:
        stopper.add_done_callback(lambda _: reader.cancel())
    try:
        while (item := await answers.get()) is not _END:
            yield item  # type: ignore[misc]
        if stop is not None and reader.cancelled():
            raise stop[1]
        await reader  # raises what ended the reading, if anything did
    finally:
        reader.cancel()
        if stopper is not None:
            stopper.cancel()
        pending = list(tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(reader, *pending, return_exceptions=True)
