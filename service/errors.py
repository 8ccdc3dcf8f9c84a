"""The service's error hierarchy, and the one place that maps it to gRPC status codes."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base of every error the service answers with on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidInput(ServiceError):
    """The client sent something malformed: rank, C, T, datatype, byte count, names."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(ServiceError):
    """Unknown model name or version."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(ServiceError):
    """The queue is full; the client may retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotReady(ServiceError):
    """Still loading, or draining for shutdown."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it could be computed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    """The client went away before the request was computed."""

    code = grpc.StatusCode.CANCELLED


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class BackendFailure(ServiceError):
    """Every backend failed on this batch: a real server fault."""

    code = grpc.StatusCode.INTERNAL


INTERNAL_MESSAGE = "internal error (request id {request_id}); the server logged the details"


def to_status(exc: BaseException, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`.

    Our own errors carry their message; anything else is a server fault, answered INTERNAL
    with a generic message so that internals never leak (the caller logs the trace).
    """
    if isinstance(exc, BackendFailure):
        return exc.code, INTERNAL_MESSAGE.format(request_id=request_id)
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE.format(request_id=request_id)
