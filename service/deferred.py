"""Bookkeeping after the answer: what a request leaves to traces and logs (a traced call's span,
a traced batch's report, a log line somebody reads) and a look at the serving backends after a
batch that may have changed them run once the event loop has handed its response to gRPC, not
before. Nothing that decides an answer is deferred. (Metrics and statistics go to the ledger,
service/ledger.py: an append per request, applied in bulk.)

The records left during one turn of the loop run together, in order, from one callback of the
next: a callback of the loop costs more than most of them (bench/request_path.py)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Record = tuple[contextvars.Context, Callable[..., None], tuple[Any, ...]]


class _Waiting(threading.local):
    """The records waiting for the next turn of this thread's running loop."""

    loop: asyncio.AbstractEventLoop | None = None
    records: list[Record]


_waiting = _Waiting()


def after_answer(record: Callable[..., None], *args: Any) -> None:
    """Run `record(*args)` at the event loop's next turn, in the caller's context (its request id
    for the logs), after the task that answers has yielded (its response handed to gRPC); at once
    without a loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # a synchronous caller (a test, a tool): nothing to wait for
        record(*args)
        return
    if _waiting.loop is not loop:  # the first record of this loop (a thread may run several, in turn)
        _waiting.loop, _waiting.records = loop, []
    waiting = _waiting.records
    if not waiting:
        loop.call_soon(_run_waiting, waiting)
    waiting.append((contextvars.copy_context(), record, args))


def _run_waiting(waiting: list[Record]) -> None:
    """Every record waiting, in the order they were left; one that fails is logged, and the
    others still run."""
    records = waiting.copy()
    waiting.clear()  # a record that leaves another schedules a turn of its own
    for context, record, args in records:
        try:
            context.run(record, *args)
        except Exception:  # bookkeeping must never stop the rest of it
            log.exception("bookkeeping after an answer failed: %s", getattr(record, "__qualname__", record))
