"""The event loop's handler for failed accepts: said once per interval, with a count."""

from __future__ import annotations

import asyncio
import logging

import pytest

from service.logs import OUT_OF_RESOURCES, AcceptFailures
from tests.support import ManualClock


def test_failed_accepts_are_said_once_per_interval_with_their_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    handler = AcceptFailures(every_s=10, clock=clock.now)
    loop = asyncio.new_event_loop()
    failure = {"message": OUT_OF_RESOURCES, "exception": OSError(24, "Too many open files")}
    try:
        with caplog.at_level(logging.ERROR, logger="service.logs"):
            for _ in range(500):
                handler(loop, failure)
            clock.advance(9.9)
            handler(loop, failure)
            assert len(caplog.records) == 1 and "(1 failed accepts" in caplog.records[0].getMessage()
            clock.advance(0.1)
            handler(loop, failure)
            assert len(caplog.records) == 2 and "(501 failed accepts" in caplog.records[1].getMessage()
        with caplog.at_level(logging.ERROR, logger="asyncio"):  # anything else: the loop's own handler
            handler(loop, {"message": "Task exception was never retrieved"})
        assert caplog.records[-1].name == "asyncio"
    finally:
        loop.close()
