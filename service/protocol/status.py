"""The one place that maps the service's errors to gRPC status codes and client messages."""

from __future__ import annotations

import grpc

from service.errors import (
    ClientGone,
    ClientTooSlow,
    DeadlineExceeded,
    FeatureOff,
    InvalidInput,
    NotFound,
    NotReady,
    Overloaded,
    PermissionDenied,
    Precondition,
    RegionExists,
    Relayed,
    ServiceError,
    TooLarge,
    Unauthenticated,
    UnsupportedEncoding,
)

STATUS: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    RegionExists: grpc.StatusCode.ALREADY_EXISTS,
    FeatureOff: grpc.StatusCode.UNIMPLEMENTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ClientGone: grpc.StatusCode.CANCELLED,
    Precondition: grpc.StatusCode.FAILED_PRECONDITION,
}

MESSAGE_LIMIT = 1000  # characters of an error message a client receives
INTERNAL_MESSAGE = "internal error (request id {request_id}); the server logged the details"


def to_status(exc: BaseException, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`.

    Our own errors carry their message; anything else (and BackendFailure) is a server fault,
    answered INTERNAL with a generic message so that internals never leak (the caller logs it).
    """
    if isinstance(exc, Relayed):  # another worker's answer, mapped there
        return grpc.StatusCode[exc.status], _bounded(str(exc))
    for cls in type(exc).__mro__:  # the nearest mapped class: subclasses keep their parent's code
        if cls in STATUS:
            return STATUS[cls], _bounded(str(exc))
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE.format(request_id=request_id)


def _bounded(message: str) -> str:
    """A message as a client receives it: cut, whatever of the client's it quotes (a gRPC status
    travels in a trailer, which clients refuse past 16 KiB)."""
    if len(message) <= MESSAGE_LIMIT:
        return message
    return f"{message[:MESSAGE_LIMIT]}... ({len(message)} characters)"


HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
SERVER_FAULTS = frozenset(  # a span's status is ERROR for these only (OpenTelemetry's gRPC server rule)
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def http_status(code: grpc.StatusCode, error: BaseException | None) -> int:
    """The HTTP status of a call's outcome: its gRPC code's, but 413 for a body that can never fit
    (429 would say: retry), 415 for a body in an encoding the server does not read, and 408 for a
    body that did not arrive in time."""
    if isinstance(error, TooLarge):
        return 413
    if isinstance(error, ClientTooSlow):
        return 408
    return 415 if isinstance(error, UnsupportedEncoding) else HTTP_STATUS.get(code, 500)
