"""OpenTelemetry traces, off by default: one span per call (gRPC or HTTP), its queue wait, the batch
it was computed in (one span per batch, linked both ways with its requests' spans) and each decode
step.

Turned on by `--otlp-endpoint` or the standard environment (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES` as the SDK reads them), exported over OTLP/HTTP by a background thread.
A call that carries a W3C `traceparent` continues the client's trace and is recorded even when
the sampler would skip it (Triton's rule). Off, `Tracing.enabled` is False and every caller skips
its tracing work with that one check.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.errors import InvalidInput, Precondition

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from service.batching import BatchEvent

PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate
NO_SPAN: AbstractContextManager[None] = contextlib.nullcontext()  # a step's, when tracing is off

log = logging.getLogger(__name__)

SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True)
class TraceSettings:
    """What the server knows of itself, for the resource every span carries."""

    endpoint: str | None  # --otlp-endpoint; None: the environment decides
    service_name: str
    instance: str  # the pod (replica) name
    worker: int
    model_name: str
    model_version: str


def wanted(endpoint: str | None, environ: Mapping[str, str]) -> bool:
    """Is tracing on: an endpoint given, and the SDK not disabled by the environment."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or environ.get("OTEL_TRACES_EXPORTER") == "none":
        return False
    return bool(endpoint or any(environ.get(v) for v in ENDPOINT_VARIABLES))


def check_tracing(endpoint: str | None, environ: Mapping[str, str]) -> Any:
    """The root sampler OTEL_TRACES_SAMPLER names, or ValueError for what `Tracing.configure`
    refuses: a malformed sampler even while tracing is off, so that turning it on later never
    meets a refusal first; a malformed endpoint while on."""
    root = root_sampler(environ)
    if wanted(endpoint, environ):
        check_endpoints(endpoint, environ)
    return root


def check_endpoints(endpoint: str | None, environ: Mapping[str, str]) -> None:
    """ValueError for an endpoint that is not an http(s) URL with a host: the exporter would
    take it and lose every span in the background, each export failing where nobody looks."""
    for source, value in (("--otlp-endpoint", endpoint), *((v, environ.get(v)) for v in ENDPOINT_VARIABLES)):
        if not value:
            continue
        try:
            parts = urlsplit(value)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 1) > 0
        except ValueError:  # a port that is not a number, or out of range
            valid = False
        if not valid:
            raise ValueError(f"{source} {value[:100]!r}: expected an OTLP/HTTP URL such as http://otel-collector:4318")


def pass_trace_on(carrier: dict[str, str]) -> bool:
    """For a call handed to another worker: write the trace context of the span current here into
    `carrier`, where it is recorded (its part there then joins the trace). False where the call
    was not sampled: the other worker records none of it either (a traceparent, even unsampled,
    is a client's, which it would record)."""
    context = trace.get_current_span().get_span_context()
    if context.trace_flags.sampled:
        PROPAGATOR.inject(carrier)
    return context.trace_flags.sampled or not context.is_valid


class Tracing:
    """The server's tracer; `Tracing()` is off."""

    def __init__(self, provider: TracerProvider | None = None, sampler: ClientTraceFirst | None = None) -> None:
        self._provider = provider
        self.enabled = provider is not None
        self.control = TraceControl(sampler)  # Triton's trace settings, at run time
        self._tracer: Tracer | None = provider.get_tracer("mha-serve") if provider is not None else None

    @classmethod
    def configure(cls, settings: TraceSettings, environ: Mapping[str, str]) -> Tracing:
        """Tracing as the settings and OTEL_* ask; a malformed sampler is refused (ValueError) even
        while tracing is off, so that turning it on later never meets a refusal first."""
        root = check_tracing(settings.endpoint, environ)
        if not wanted(settings.endpoint, environ):
            return cls()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        ours: dict[str, str | int] = {
            "service.name": settings.service_name,
            "service.instance.id": f"{settings.instance}/{settings.worker}",
            "k8s.pod.name": settings.instance,
            "mha.worker": settings.worker,
            "mha.model.name": settings.model_name,
            "mha.model.version": settings.model_version,
        }
        # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME win over ours (Resource.create alone lets
        # the code's attributes win)
        resource = Resource.create(ours).merge(OTELResourceDetector().detect())
        sampler = ClientTraceFirst(root)
        provider = TracerProvider(resource=resource, sampler=sampler)
        endpoint = settings.endpoint
        exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces") if endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing on: spans exported over OTLP/HTTP to %s", endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
        return cls(provider, sampler)

    def start_call(self, name: str, carrier: Mapping[str, str] | None, attributes: dict[str, Any]) -> CallSpan | None:
        """The span of one call, continuing the client's trace when the carrier holds a
        `traceparent`, made current until `CallSpan.end`."""
        if self._tracer is None:
            return None
        parent = PROPAGATOR.extract(carrier) if carrier else None
        span = self._tracer.start_span(name, parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        return CallSpan(span, otel_context.attach(trace.set_span_in_context(span)))

    def current(self) -> Span | None:
        """The span of the call being served in this task, to hand to the batcher."""
        if self._tracer is None:
            return None
        span = trace.get_current_span()
        return span if span.get_span_context().is_valid else None

    def report_batch(self, event: BatchEvent, fallback: str = "") -> None:
        """One span per executed batch, linked to its requests' spans (and each of those back
        to it), and each request's queue wait as a child of its own span."""
        if self._tracer is None or not event.traced:
            return
        wall = _WallClock(event.ended)
        started = event.ended - event.compute_s
        requests: list[Span] = [span for span, _ in event.traced]
        attributes: dict[str, Any] = {
            "mha.batch.requests": event.requests,
            "mha.batch.rows": event.rows,
            "mha.batch.padded_tokens": event.padded_tokens,
            "mha.backend": event.backend,
            "mha.batch.formation_ms": round(event.formation_s * 1e3, 3),
        }
        if fallback:
            attributes["mha.fallback"] = fallback
        links = [Link(span.get_span_context()) for span in requests]
        batch = self._tracer.start_span(
            "batch", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links,
            attributes=attributes, start_time=wall(started),
        )  # fmt: skip
        if event.error is not None:
            batch.set_status(Status(StatusCode.ERROR, type(event.error).__name__))
        batch.end(end_time=wall(event.ended))
        for span, enqueued in event.traced:
            span.add_link(batch.get_span_context(), {"mha.link": "computed in"})
            queue = self._tracer.start_span("queue", context=trace.set_span_in_context(span), start_time=wall(enqueued))
            queue.end(end_time=wall(started))

    def step(self, sequence_id: Callable[[], str], tokens: int) -> AbstractContextManager[Span | None]:
        """A decode step's span, child of the current call's: the caller adds the tokens held.
        `sequence_id` is asked only when tracing is on (nothing is built for a step otherwise)."""
        if self._tracer is None:
            return NO_SPAN
        attributes: dict[str, str | int] = {"mha.sequence_id": sequence_id(), "mha.step.tokens": tokens}
        return self._tracer.start_as_current_span("decode step", attributes=attributes)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export what is buffered now; True when it went out in time (or tracing is off)."""
        return self._provider.force_flush(int(timeout_s * 1000)) if self._provider is not None else True

    def shutdown(self) -> None:
        """Flush what is buffered (the drain's last spans) and stop the export thread."""
        if self._provider is not None:
            self._provider.shutdown()


class CallSpan:
    """A call's span, current in the task that serves the call until `detach` (called there);
    `end` records its status, possibly later and elsewhere (a stream's answer, once written)."""

    def __init__(self, span: Span, token: object) -> None:
        self.span, self._token = span, token

    def detach(self) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None

    @property
    def trace_id(self) -> str | None:
        """The trace id (32 hex digits) when the span is sampled: the exemplar of its latency."""
        context = self.span.get_span_context()
        return format(context.trace_id, "032x") if context.trace_flags.sampled else None

    def end(self, attributes: dict[str, Any], fault: str | None) -> None:
        self.span.set_attributes(attributes)
        if fault is not None:
            self.span.set_status(Status(StatusCode.ERROR, fault))
        self.span.end()


class _WallClock:
    """Times on a batcher's monotonic clock as wall-clock nanoseconds, anchored at `now`."""

    def __init__(self, now: float) -> None:
        self._now, self._wall = now, time.time_ns()

    def __call__(self, t: float) -> int:
        return self._wall - int((self._now - t) * 1e9)


def root_sampler(environ: Mapping[str, str]) -> Any:
    """The sampler OTEL_TRACES_SAMPLER names (default parentbased_always_on: everything)."""
    from opentelemetry.sdk.trace import sampling

    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if name not in SAMPLERS:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r}: expected one of {', '.join(SAMPLERS)}")
    if name.endswith("always_on"):
        return sampling.ALWAYS_ON
    if name.endswith("always_off"):
        return sampling.ALWAYS_OFF
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
    try:
        ratio = float(arg)
    except ValueError:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: expected a ratio from 0 to 1") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: expected a ratio from 0 to 1")
    return sampling.TraceIdRatioBased(ratio)


class ClientTraceFirst(Sampler):
    """A call that continues a client's trace (a remote parent) is recorded whatever its flags
    say, as Triton does; any other span (a call without traceparent, a batch) asks `root`. A child
    of a local span follows its parent."""

    def __init__(self, root: Any) -> None:
        self.root = root  # what a call without a client's trace asks (trace settings swap it)
        self.off = False  # trace_level OFF: nothing is recorded, a client's trace included

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Sequence[Any] | None = None,
        trace_state: Any = None,
    ) -> Any:
        parent = trace.get_current_span(parent_context).get_span_context()
        if self.off:
            return SamplingResult(Decision.DROP, None, parent.trace_state)
        if parent.is_valid and (parent.is_remote or parent.trace_flags.sampled):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
        if parent.is_valid:
            return SamplingResult(Decision.DROP, None, parent.trace_state)
        if any(link.context.trace_flags.sampled for link in links or ()):  # a batch of a sampled request
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.root.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"ClientTraceFirst{{{self.root.get_description()}}}"


TRACE_FIXED = {"trace_count": "-1", "log_frequency": "0", "trace_file": "", "trace_mode": "opentelemetry"}
TRACE_KEYS = ("trace_level", "trace_rate", *TRACE_FIXED)
TraceValues = dict[str, list[str]]


class TraceControl:
    """Triton's trace settings mapped onto OpenTelemetry, changed while the server runs.
    `trace_level` OFF records nothing (a client's trace included); TIMESTAMPS records spans (only
    where tracing was configured at start: it names where they go). `trace_rate` N records one
    trace in N of the calls that carry no trace of their own (0: only those that do). The rest
    hold the one value offered: spans go over OTLP, with no count, log or file of Triton's."""

    def __init__(self, sampler: ClientTraceFirst | None) -> None:
        self._sampler = sampler
        self._rate = _rate_of(sampler.root) if sampler is not None else 1
        self._initial = self.settings()

    def settings(self) -> TraceValues:
        level = "TIMESTAMPS" if self._sampler is not None and not self._sampler.off else "OFF"
        return {"trace_level": [level], "trace_rate": [str(self._rate)], **{k: [v] for k, v in TRACE_FIXED.items()}}

    def change(self, changes: Mapping[str, list[str] | None]) -> TraceValues:
        """Apply `changes` (None: back to the value at start) and return the settings; a mistake
        changes nothing (InvalidInput, or Precondition for spans where tracing is off)."""
        wanted = self.settings()
        for key, values in changes.items():
            if key not in TRACE_KEYS:
                raise InvalidInput(f"trace setting {key[:64]!r}: expected one of {', '.join(TRACE_KEYS)}")
            wanted[key] = self._initial[key] if values is None else [str(v)[:64] for v in values]
        for key, value in TRACE_FIXED.items():
            if wanted[key] != [value]:
                raise InvalidInput(f"{key} {_listed(wanted[key])}: only {value!r} is offered here ({_FIXED_WHY[key]})")
        level, rate = wanted["trace_level"], wanted["trace_rate"]
        if level not in (["OFF"], ["TIMESTAMPS"]):
            raise InvalidInput(
                f'trace_level {_listed(level)}: expected ["OFF"] or ["TIMESTAMPS"] (tensors are not traced)'
            )
        if len(rate) != 1 or not (rate[0].isascii() and rate[0].isdigit()) or int(rate[0]) > MAX_TRACE_RATE:
            raise InvalidInput(
                f"trace_rate {_listed(rate)}: expected one count N from 0 to {MAX_TRACE_RATE} (one trace in N; "
                "0: only clients' traces)"
            )
        if level == ["TIMESTAMPS"] and self._sampler is None:
            raise Precondition("tracing is off: start the server with --otlp-endpoint (or OTEL_EXPORTER_OTLP_*)")
        self._rate = int(rate[0])
        if self._sampler is not None:
            self._sampler.off, self._sampler.root = level == ["OFF"], _root_of(self._rate)
        return self.settings()


MAX_TRACE_RATE = 2**32 - 1  # Triton's (uint32)


def _listed(values: list[str]) -> str:
    """A client's list of values for a message: the first few (each already cut to 64 characters)."""
    more = f" and {len(values) - 4} more" if len(values) > 4 else ""
    return f"{values[:4]}{more}"


_FIXED_WHY = {
    "trace_count": "no limit; trace_level OFF stops tracing",
    "log_frequency": "spans are exported as they end",
    "trace_file": "spans go over OTLP to --otlp-endpoint",
    "trace_mode": "spans are OpenTelemetry's",
}


def _rate_of(root: Any) -> int:
    """A root sampler as Triton's trace_rate: 1 (every trace), N (one in N), 0 (none)."""
    from opentelemetry.sdk.trace import sampling

    if root is sampling.ALWAYS_ON:
        return 1
    ratio = root.rate if isinstance(root, sampling.TraceIdRatioBased) else 0.0
    return round(1 / ratio) if ratio > 0 else 0


def _root_of(rate: int) -> Any:
    from opentelemetry.sdk.trace import sampling

    if rate == 1:
        return sampling.ALWAYS_ON
    return sampling.TraceIdRatioBased(1 / rate) if rate > 0 else sampling.ALWAYS_OFF
