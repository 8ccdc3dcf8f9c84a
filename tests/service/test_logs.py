"""The log's lines: each with the request id of its call and, among several workers, the worker
that wrote it; the event loop's handler for failed accepts, said once per interval, with a count."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from service.logs import OUT_OF_RESOURCES, TEXT_FORMAT, AcceptFailures, JsonFormatter, RequestIdFilter, request_id_var
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


def _written(worker: int | None, formatter: logging.Formatter) -> str:
    """What one line logged within a call looks like, from a worker `worker` (None: a lone server)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestIdFilter(worker))
    handler.setFormatter(formatter)
    logger = logging.getLogger("tests.logs.written")
    logger.addHandler(handler)
    logger.propagate = False
    token = request_id_var.set("5681d1bd00000002")
    try:
        logger.warning("a line")
    finally:
        request_id_var.reset(token)
        logger.removeHandler(handler)
    return out.getvalue()


def test_each_line_says_its_request_id_and_the_worker_that_wrote_it() -> None:
    line = json.loads(_written(1, JsonFormatter()))
    assert line["worker"] == 1 and line["request_id"] == "5681d1bd00000002" and line["msg"] == "a line"
    assert json.loads(_written(0, JsonFormatter()))["worker"] == 0  # worker 0 is named too, not taken for none
    assert "worker" not in json.loads(_written(None, JsonFormatter()))  # a lone server: no field
    text = logging.Formatter(TEXT_FORMAT)
    assert _written(2, text).endswith(" WARNING worker 2 tests.logs.written [5681d1bd00000002] a line\n")
    assert _written(None, text).endswith(" WARNING tests.logs.written [5681d1bd00000002] a line\n")
