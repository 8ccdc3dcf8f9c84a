"""One call's bookkeeping, the same for unary calls, requests inside a stream and refused calls:
request id, in-flight count, metrics, statistics, logs, and the mapping from errors to status.

    async with calls.unary("ModelReady", context):
        ...  # raise a ServiceError to answer with its status; return the response

Unary scopes abort the call with the mapped status; stream-item scopes keep the status on the
`Call` so that the stream answers in-band and goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from service.budget import Lease
from service.deferred import after_answer
from service.engine.door import Door
from service.errors import ServiceError
from service.logs import new_request_id, request_id_var
from service.metrics import Metrics
from service.protocol.status import SERVER_FAULTS, http_status, to_status
from service.tracing import CallSpan, Tracing

log = logging.getLogger(__name__)
LEFT = (asyncio.CancelledError, GeneratorExit)  # the client left, or its deadline passed

ClosedCall = tuple[
    str, grpc.StatusCode, float, bool, str, bool, str
]  # method, code, s, inference, trace, step, version


@dataclass(slots=True)
class Call:
    method: str
    request_id: str
    inference: bool  # counted in flight and in the model's statistics
    step: bool = False  # an inference that was a decode step: the sequence model's statistics
    version: str = ""  # the model version it went to (its statistics'); "" before it was routed
    started: float = field(default_factory=time.perf_counter)
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""  # what a failed call answered
    error: BaseException | None = None  # what made it fail
    http: bool = False  # answered over HTTP (its span says so)
    span: CallSpan | None = None  # its trace span, when tracing is on
    leases: list[Lease] = field(default_factory=list)  # its bytes in the in-flight budget, until it closes
    computed: bool = False  # an inference whose answer is computed (or failed): it will join no batch

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


HANDED_OVER = "HandedOver"  # the method, on the worker that computes it, of a request another worker handed over
REQUEST_ID_HEADER = "x-request-id"  # gRPC metadata and HTTP header: a proxy's id of the call, taken as its own
DEADLINE_SLACK_S = 0.1  # the client's deadline fires before ours by the request's transit time
DEADLINE_RACE_S = 0.002  # a refusal this close to the call's deadline is left to gRPC's


LEFT_BEFORE_ANSWER = {  # what a call's log line says when it ended under us
    grpc.StatusCode.DEADLINE_EXCEEDED: "its deadline passed before the answer",
    grpc.StatusCode.CANCELLED: "the client cancelled it or went away before the answer",
}


def _ended_code(context: grpc.aio.ServicerContext | None) -> grpc.StatusCode:
    """Why a call was cancelled under us: its deadline passed (the client's timer, which runs a
    little ahead of ours, may end the call first), or the client went away."""
    remaining = context.time_remaining() if context is not None else None
    expired = remaining is not None and remaining <= DEADLINE_SLACK_S
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


class Calls:
    def __init__(self, door: Door, metrics: Metrics, tracing: Tracing) -> None:
        self._door, self._metrics, self.tracing = door, metrics, tracing
        self._requests = door.requests  # opened, computed and closed by every inference call
        self._book = metrics.ledger.book(self._fold)

    def unary(
        self, method: str, context: grpc.aio.ServicerContext, client_id: str = "", inference: bool = False
    ) -> UnaryScope:
        """`client_id`: the request's own id, where it has one and the client set it."""
        return UnaryScope(self, context, Call(method, new_request_id(client_id or _forwarded_id(context)), inference))

    def stream_item(self, method: str, context: grpc.aio.ServicerContext, client_id: str) -> StreamItemScope:
        call = Call(method, new_request_id(client_id or _forwarded_id(context)), inference=True)
        return StreamItemScope(self, context, call)

    def in_band(
        self,
        method: str,
        context: grpc.aio.ServicerContext | None,
        client_id: str = "",
        inference: bool = False,
        headers: Mapping[str, str] | None = None,
        carrier: Mapping[str, str] | None = None,
        traced: bool = True,
    ) -> InBandScope:
        """A call answered by other means than a gRPC status (HTTP, with its `headers`; a worker's
        hand-over, with the trace `carrier` of the call that handed it over, and not `traced`
        where that call is not): the status stays on the Call."""
        call = Call(method, new_request_id(client_id), inference, http=headers is not None)
        scope = InBandScope(self, context, call, headers if headers is not None else carrier)
        scope.traced = traced
        return scope

    @staticmethod
    def named(call: Call, client_id: str) -> None:
        """`call` goes by the client's own id, read after its scope opened (an HTTP body's): the
        lines logged from here on carry it, and so do its status and span."""
        call.request_id = new_request_id(client_id)
        request_id_var.set(call.request_id)  # in the call's task: its scope's exit restores what was before

    def stream(self, method: str, context: grpc.aio.ServicerContext) -> StreamScope:
        return StreamScope(self, context, Call(method, new_request_id(), inference=False))

    async def refuse(self, method: str, context: grpc.aio.ServicerContext, error: ServiceError) -> None:
        """Answer a call refused before it reached the servicer (e.g. by authentication)."""
        async with self.unary(method, context):
            raise error

    def opened(self, call: Call, traced: bool = False, carrier: Mapping[str, str] | None = None) -> None:
        """A call begins: counted in flight; traced (continuing the trace `carrier` names) if asked."""
        if call.inference:
            self._requests.started()
        if traced:
            call.span = self.tracing.start_call(call.method, carrier, _span_attributes(call))

    def computed(self, call: Call) -> None:
        """An inference's answer is computed (or it failed): it no longer keeps a batch waiting
        for company, though it stays in flight until its answer is written."""
        if call.inference and not call.computed:
            call.computed = True
            self._requests.computed()

    def failed(self, call: Call, exc: BaseException) -> None:
        call.error = exc
        call.code, call.message = to_status(exc, call.request_id)
        if call.code is grpc.StatusCode.INTERNAL:  # a server fault: the trace goes to the log only
            log.error("%s failed: %s", call.method, exc, exc_info=exc)

    def closed(self, call: Call) -> None:
        """A call ends: out of the in-flight count and written in the ledger now (counted and
        timed when the metrics or statistics are next read); its span ended and its line logged
        after its response has gone (after_answer)."""
        elapsed = time.perf_counter() - call.started
        for lease in call.leases:
            lease.release()
        if call.inference:
            self._requests.finished(call.computed)
        span = call.span
        trace = (span.trace_id or "") if span else ""
        self._book.add((call.method, call.code, elapsed, call.inference, trace, call.step, call.version))
        if span is not None:
            after_answer(self._end_span, call)
        ok = call.ok
        level = logging.DEBUG if ok else logging.INFO  # a client's mistake or leaving; faults: in failed()
        if (call.inference or not ok) and log.isEnabledFor(level):  # no record built that nobody reads
            after_answer(self._log, call, elapsed, level)

    def _fold(self, records: list[ClosedCall]) -> None:
        """Calls, in bulk: into the metrics, and the inference requests into their version's
        statistics (a request refused before it reached a version: the latest's)."""
        self._metrics.requests.observe_calls(
            (method, code.name, s, trace) for method, code, s, _, trace, _, _ in records
        )
        inferences = [  # a handed-over request is in the statistics of the worker its client called
            (version, step, code.name, s)
            for method, code, s, inference, _, step, version in records
            if inference and method != HANDED_OVER
        ]
        if inferences:
            self._door.requests_closed(inferences)

    @staticmethod
    def _log(call: Call, elapsed: float, level: int) -> None:
        extra = {"method": call.method, "code": call.code.name, "duration_ms": round(elapsed * 1e3, 3)}
        log.log(level, "%s %s %s", call.method, call.code.name, call.message, extra=extra)

    @staticmethod
    def _end_span(call: Call) -> None:
        assert call.span is not None
        status = (
            {"http.response.status_code": http_status(call.code, call.error)}
            if call.http
            else {"rpc.grpc.status_code": call.code.value[0]}
        )
        fault = f"{call.code.name}: {call.message[:200]}" if call.code in SERVER_FAULTS else None
        call.span.end({**status, "mha.code": call.code.name, "mha.request_id": call.request_id}, fault)
        call.span = None


def _span_attributes(call: Call) -> dict[str, str]:
    where = {"http.request.method": "POST" if call.inference else "GET"} if call.http else {"rpc.system": "grpc"}
    return {
        **where,
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": call.method,
        "mha.request_id": call.request_id,
    }


def _forwarded_id(context: grpc.aio.ServicerContext) -> str:
    """The call's `x-request-id` metadata (what Envoy, Istio and an nginx in front set), or ""."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER:
            return value if isinstance(value, str) else ""
    return ""


def _carrier(context: grpc.aio.ServicerContext | None) -> Mapping[str, str] | None:
    """A gRPC call's metadata, where a client's `traceparent` is."""
    if context is None:
        return None
    metadata = context.invocation_metadata()
    return {key: value for key, value in metadata or () if isinstance(value, str)}


class _Scope:
    traced = True  # a span of its own (a stream as a whole has none: its requests do)

    def __init__(
        self,
        calls: Calls,
        context: grpc.aio.ServicerContext | None,
        call: Call,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._calls, self._context, self.call = calls, context, call
        self._token: contextvars.Token[str] | None = None
        self._headers = headers

    async def __aenter__(self) -> Call:
        self._token = request_id_var.set(self.call.request_id)
        if self.traced and self._calls.tracing.enabled:
            self._calls.opened(self.call, True, self._headers or _carrier(self._context))
        else:
            self._calls.opened(self.call)
        return self.call

    def _exit(self, exc: BaseException | None, record: bool = True) -> None:
        call = self.call
        self._calls.computed(call)  # answered or failed: a stream's answer may still wait to be written
        if exc is not None:
            if isinstance(exc, LEFT):
                call.code = _ended_code(self._context)
                call.message = LEFT_BEFORE_ANSWER[call.code]
            else:
                self._calls.failed(call, exc)
        if call.span is not None:
            call.span.detach()  # in the task that attached it; the span may end later (settle)
        if record:
            self._calls.closed(call)
        if self._token is not None:
            try:  # noqa: SIM105 (contextlib.suppress: an object and two calls on every call's path)
                request_id_var.reset(self._token)
            except ValueError:  # a stream's generator closed from another task's context
                pass


class UnaryScope(_Scope):
    """A whole call: a failure aborts it with the mapped status. Past its deadline gRPC ends the
    call with DEADLINE_EXCEEDED itself, and the scope leaves it to gRPC."""

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._context is not None, "a unary scope has a gRPC context"
        expired = not isinstance(exc, LEFT) and _past_deadline(self._context, exc is None)
        if expired and exc is None:
            self.call.code = grpc.StatusCode.DEADLINE_EXCEEDED
            self.call.message = "answered after the deadline: the answer was not delivered"
        self._exit(exc)
        if expired:  # an answer or status sent now would race gRPC's own, and fail as a server error
            raise asyncio.CancelledError
        if isinstance(exc, Exception):
            await self._context.abort(self.call.code, self.call.message)


def _past_deadline(context: grpc.aio.ServicerContext, answered: bool) -> bool:
    """Whether gRPC ends the call with DEADLINE_EXCEEDED itself: its deadline has passed (an
    answer), or passes within DEADLINE_RACE_S (a refusal: the server's own deadline check fires
    with gRPC's, by another clock)."""
    remaining = context.time_remaining()
    if remaining is None:
        return False
    return remaining <= 0 if answered else remaining <= DEADLINE_RACE_S


class InBandScope(_Scope):
    """One request of a stream, or an HTTP call: a failure is kept on the Call (answered
    in-band), a cancellation propagates."""

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._exit(exc)
        return isinstance(exc, Exception)


class StreamItemScope(_Scope):
    """One request of a stream, answered in-band. It is counted once its answer's fate is known
    (`settle`): an answer computed for a client that left before it was written is counted
    CANCELLED (or DEADLINE_EXCEEDED), not OK. A request cancelled while computing is counted at
    once."""

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._exit(exc, record=isinstance(exc, LEFT))
        return isinstance(exc, Exception)

    def settle(self, delivered: bool) -> None:
        if not delivered and self.call.ok:
            self.call.code = _ended_code(self._context)
            self.call.message = "answered after the client had left: the answer was not delivered"
        token = request_id_var.set(self.call.request_id)
        try:
            self._calls.closed(self.call)
        finally:
            request_id_var.reset(token)


class StreamScope(_Scope):
    """A stream as a whole. Its requests are counted one by one (stream_item scopes); only an
    error that ends the stream early (a message that is not a request, draining) is answered
    with its status, logged and counted here."""

    traced = False

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        failed = isinstance(exc, Exception)
        self._exit(exc, record=failed)
        if failed:
            assert self._context is not None, "a stream scope has a gRPC context"
            await self._context.abort(self.call.code, self.call.message)
