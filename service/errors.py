"""The service's error hierarchy: what went wrong, in the domain's words (no gRPC here;
`service/protocol/status.py` maps each to a status code)."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error the service answers with on purpose; the message is the client's."""


class InvalidInput(ServiceError):
    """The client sent something malformed: rank, C, T, datatype, byte count, names."""


class UnsupportedEncoding(InvalidInput):
    """An HTTP body in a Content-Encoding this server does not read (HTTP 415)."""


class NotFound(ServiceError):
    """Something the client named does not exist here."""


class ModelNotFound(NotFound):
    """Unknown model name or version."""


class RegionNotFound(NotFound):
    """A shared memory region name that is not registered."""


class SequenceNotFound(NotFound):
    """A step for a sequence that is not live: never started, ended, evicted or restarted."""


class Precondition(ServiceError):
    """The server's state does not allow what was asked, as asked: a sequence's state that is not
    the client's, a version that fails its checks."""


class StaleSequence(Precondition):
    """A step whose client believes the sequence holds a different number of tokens than this
    server does (sequence_offset): computing it would answer against a state that is not the
    client's, so it is refused and the state stays as it was."""


class Relayed(ServiceError):
    """Another worker's error answer to a request handed to it, passed on as it is: `status` is
    the name of that answer's status code."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class RegionExists(ServiceError):
    """Registering a shared memory region under a name already taken."""


class LoadRefused(Precondition):
    """A version in the repository that cannot be served (a file fails its checks): refused, and
    the versions serving go on."""


class FeatureOff(ServiceError):
    """A protocol extension this server does not offer, or that its operator turned off."""


class Overloaded(ServiceError):
    """A limit of this server is reached: the queue is full (retry later) or a message is too large."""


class TooLarge(Overloaded):
    """A message larger than this server accepts at all: it can never succeed as sent (HTTP 413)."""


class NotReady(ServiceError):
    """Still loading, or draining for shutdown."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it could be computed."""


class ClientGone(ServiceError):
    """The client went away before its request was whole (an HTTP body cut short): nobody to
    answer, and not the server's fault."""


class ClientTooSlow(ClientGone):
    """The client's HTTP body did not arrive whole within --http-read-timeout-s: it held its
    share of the in-flight budget for as long as it dripped (HTTP 408)."""


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token."""


class PermissionDenied(ServiceError):
    """A known client's call that is not its to make: a control call made with the inference token."""


class BackendFailure(ServiceError):
    """Every backend failed on this batch: a real server fault, answered without details."""


class AnswerRejected(NotReady):
    """An answer found wrong against the float64 reference before it was sent
    (--audit-before-answer): nothing was sent, its backend is quarantined, and a retry is computed
    by another (UNAVAILABLE, which clients and balancers retry)."""


class DeviceLost(NotReady):
    """A sticky CUDA error: the device's context is broken for every backend of this process,
    so nothing falls back onto it; the server stops serving and exits to be replaced. The client
    retries on another replica (UNAVAILABLE); `detail` says what broke."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"this replica lost its device ({detail[:200]}) and is restarting; retry on another")
        self.detail = detail


def quote(value: str, limit: int = 64) -> str:
    """A client-supplied string as it may appear in a message or a log line: quoted and cut."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}


def described(value: object) -> str:
    """A client's value's kind, in words the users of both protocols (JSON, gRPC parameters) read."""
    return "nothing" if value is None else KINDS.get(type(value), "something else")
