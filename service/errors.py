"""The service's error hierarchy, and the one place that maps it to gRPC status codes."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base of every error the service answers with on purpose; the message is the client's."""


class InvalidInput(ServiceError):
    """The client sent something malformed: rank, C, T, datatype, byte count, names."""


class ModelNotFound(ServiceError):
    """Unknown model name or version."""


class Overloaded(ServiceError):
    """The queue is full; the client may retry later."""


class NotReady(ServiceError):
    """Still loading, or draining for shutdown."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it could be computed."""


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token."""


class BackendFailure(ServiceError):
    """Every backend failed on this batch: a real server fault, answered without details."""


STATUS: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}

INTERNAL_MESSAGE = "internal error (request id {request_id}); the server logged the details"


def to_status(exc: BaseException, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`.

    Our own errors carry their message; anything else (and BackendFailure) is a server fault,
    answered INTERNAL with a generic message so that internals never leak (the caller logs it).
    """
    for cls in type(exc).__mro__:  # the nearest mapped class: subclasses keep their parent's code
        if cls in STATUS:
            return STATUS[cls], str(exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE.format(request_id=request_id)
