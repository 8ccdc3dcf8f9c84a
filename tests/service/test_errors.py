"""Every branch of the one mapping from errors to gRPC status codes."""

from __future__ import annotations

import grpc
import pytest

from service.errors import (
    BackendFailure,
    Cancelled,
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    NotReady,
    Overloaded,
    Unauthenticated,
    to_status,
)

CASES = [
    (InvalidInput("T = 0"), grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound("gpt"), grpc.StatusCode.NOT_FOUND),
    (Overloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReady("draining"), grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled("gone"), grpc.StatusCode.CANCELLED),
    (Unauthenticated("token"), grpc.StatusCode.UNAUTHENTICATED),
]


@pytest.mark.parametrize(("exc", "code"), CASES, ids=[c.name for _, c in CASES])
def test_service_errors_keep_their_message(exc: Exception, code: grpc.StatusCode) -> None:
    assert to_status(exc, "rid") == (code, str(exc))


def test_server_faults_are_internal_and_generic() -> None:
    for exc in (BackendFailure("ORT exploded at 0xdeadbeef"), RuntimeError("secret path /opt/x"), KeyError("k")):
        code, message = to_status(exc, "req-42")
        assert code is grpc.StatusCode.INTERNAL
        assert "req-42" in message and "0xdeadbeef" not in message and "/opt/x" not in message
