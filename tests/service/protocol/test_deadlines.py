"""A unary call whose deadline passes as it is answered: gRPC ends it with DEADLINE_EXCEEDED
itself, so the call scope counts it so and sends nothing after it (a status sent then races
gRPC's, and fails as a server error)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from service.errors import DeadlineExceeded
from service.protocol.calls import Calls
from tests.support import ServerThread, make_settings

CODES = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")
METHOD = "/test.Late/Answer"


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as s:
        yield s


def _counts(server: ServerThread, method: str) -> dict[str, float]:
    get = server.registry.get_sample_value
    return {c: get("mha_requests_total", {"method": method, "code": c}) or 0.0 for c in CODES}


async def _call_late(calls: Calls, method: str, how: str) -> grpc.StatusCode:
    """One call to a real gRPC server whose handler, inside the call scope, is still at work when
    the call's 0.1 s deadline passes: it keeps the loop busy, then answers or refuses, or it
    waits (gRPC cancels it under it). The code the client got."""

    async def late(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with calls.unary(method, context, inference=True):
            if how == "waiting":
                await asyncio.sleep(0.4)
            time.sleep(0.4)  # the loop is busy: gRPC's own end of the call waits behind it
            if how == "refused":
                raise DeadlineExceeded("deadline passed in the queue")  # the server's own check, by its clock
            return b"late"

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(late)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Late", {"Answer": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await channel.unary_unary(METHOD)(b"x", timeout=0.1)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    finally:  # after the server's own end of the call: stop(0) could cancel it first, as a shutdown does
        await server.stop(5)


WHY = {
    "answered": "answered after the deadline",
    "refused": "deadline passed in the queue",
    "waiting": "its deadline passed before the answer",
}


@pytest.mark.parametrize("how", list(WHY))
def test_a_call_still_at_work_at_its_deadline_is_counted_deadline_exceeded_logs_why_and_no_error(
    server: ServerThread, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    engine = server.engine
    calls = Calls(engine.door, engine.metrics, engine.tracing)
    method = f"Late{how}"
    assert asyncio.run(_call_late(calls, method, how)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _counts(server, method) == {**dict.fromkeys(CODES, 0.0), "DEADLINE_EXCEEDED": 1.0}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(method)]
    assert len(lines) == 1 and WHY[how] in lines[0], lines  # the call's one log line says why
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
