"""The one mapping from errors to gRPC status codes: complete, inherited, and discreet."""

from __future__ import annotations

import grpc
import pytest

from service import errors
from service.errors import BackendFailure, InvalidInput, ServiceError
from service.protocol.status import to_status

ANSWERED_AS_SERVER_FAULTS = {BackendFailure}


def _service_errors() -> list[type[ServiceError]]:
    return [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, ServiceError) and cls not in (ServiceError, errors.Relayed)
    ]


@pytest.mark.parametrize("cls", _service_errors(), ids=lambda c: c.__name__)
def test_every_client_facing_error_has_its_own_status_and_keeps_its_message(cls: type[ServiceError]) -> None:
    error = cls("T = 0; expected T >= 1")
    code, message = to_status(error, "rid")
    if issubclass(cls, tuple(ANSWERED_AS_SERVER_FAULTS)):
        assert code is grpc.StatusCode.INTERNAL and "T = 0" not in message
    else:
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK), cls
        assert message == str(error) and "T = 0; expected T >= 1" in message  # its own words, the detail kept


def test_codes_are_distinct() -> None:
    """Two kinds of error with one code would be one error: a client could not tell them apart.
    (A subclass, such as ModelNotFound of NotFound, is a kind of its parent and keeps its code.)"""
    kinds = [cls for cls in _service_errors() if cls.__bases__ == (ServiceError,)]
    codes = [to_status(cls("m"), "rid")[0] for cls in kinds if not issubclass(cls, tuple(ANSWERED_AS_SERVER_FAULTS))]
    assert len(codes) == len(set(codes))


def test_a_subclass_answers_with_its_parents_code() -> None:
    class TooLong(InvalidInput):
        pass

    assert to_status(TooLong("T = 9000"), "rid") == (grpc.StatusCode.INVALID_ARGUMENT, "T = 9000")


def test_server_faults_are_internal_and_generic() -> None:
    for exc in (BackendFailure("ORT exploded at 0xdeadbeef"), RuntimeError("secret path /opt/x"), KeyError("k")):
        code, message = to_status(exc, "req-42")
        assert code is grpc.StatusCode.INTERNAL
        assert "req-42" in message and "0xdeadbeef" not in message and "/opt/x" not in message


def test_another_workers_answer_is_passed_on_as_it_is() -> None:
    for code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL):
        assert to_status(errors.Relayed(code.name, "as the owner said"), "rid") == (code, "as the owner said")
