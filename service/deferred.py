"""Bookkeeping after the answer: what a request leaves to metrics, statistics, traces and logs
runs once the event loop has handed its response to gRPC, not before (bench/compare.py: a lone
client waits for none of it). Nothing that decides an answer is deferred."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def after_answer(record: Callable[..., None], *args: Any) -> None:
    """Run `record(*args)` at the event loop's next turn, in the caller's context (its request id
    for the logs), after the task that answers has sent its response; at once without a loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # a synchronous caller (a test, a tool): nothing to wait for
        record(*args)
        return
    loop.call_soon(record, *args)
