"""Answering a stream of requests concurrently, with nothing left running when it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar, cast

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_END = object()


async def answer_concurrently(
    requests: AsyncIterator[Req],
    answer: Callable[[Req], Awaitable[Resp]],
    stop: tuple[asyncio.Event, Exception] | None = None,
    settle: Callable[[Resp, bool], None] | None = None,
    window: int | None = None,
) -> AsyncGenerator[Resp, None]:
    """Answer each request on its own task and yield the answers as they complete.

    Requests of one stream may so share batches. Whenever the consumer stops, because the
    requests ended and all were answered, the client cancelled, the deadline passed or the
    stream was closed, the reader and every unanswered request are cancelled and awaited:
    nothing keeps computing for a client that has gone. An error reading the requests is
    raised once the requests read before it are answered. `stop` = (event, error): once the
    event is set, reading stops and, after the answers to what was read, `error` is raised.

    `settle(answer, delivered)` is called once for every answer computed: delivered is True
    once the consumer came back for the next one (gRPC has written it), False for an answer
    the consumer never took, or took but never came back from (its write did not complete).

    `window`: at most this many requests read and not yet delivered (computing, or answered and
    waiting to be written). Past it, reading stops until an answer is delivered, so a client
    that sends and never reads is held by gRPC's flow control instead of filling the server.
    """
    answers: asyncio.Queue[object] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()
    room = asyncio.Semaphore(window) if window is not None else None

    async def one(request: Req) -> None:
        await answers.put(await answer(request))

    async def read() -> None:
        iterator = aiter(requests)
        try:
            while True:
                if room is not None:
                    await room.acquire()
                try:
                    request = await anext(iterator)
                except StopAsyncIteration:
                    break
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
    settled = settle or _unsettled
    in_hand: list[Resp] = []  # the answer yielded and not yet known written (at most one)
    try:
        while (item := await answers.get()) is not _END:
            in_hand.append(cast(Resp, item))
            yield in_hand[0]
            settled(in_hand.pop(), True)
            if room is not None:
                room.release()
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
        cancelled_again = await _wait_out(reader, *pending)
        while not answers.empty():  # computed, never taken
            if (left := answers.get_nowait()) is not _END:
                in_hand.append(cast(Resp, left))
        for undelivered in in_hand:
            settled(undelivered, False)
        if cancelled_again:
            raise asyncio.CancelledError


async def _wait_out(*tasks: asyncio.Task[None]) -> bool:
    """Wait until every (cancelled) task has ended, even when this wait is itself cancelled (as
    gRPC cancels a handler whose client left): nothing may be left to put an answer nobody
    settles. True if the wait was cancelled."""
    cancelled = False
    while True:
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
            return cancelled
        except asyncio.CancelledError:
            cancelled = True


def _unsettled(answer: object, delivered: bool) -> None:
    """No `settle` given: nothing to record."""
