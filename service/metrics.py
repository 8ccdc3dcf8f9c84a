"""Prometheus metrics on an injected CollectorRegistry (no global state, no `_created` series)."""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client import disable_created_metrics as _disable_created
from prometheus_client.metrics_core import Metric

from service.batching import BatchEvent
from service.ledger import Ledger

log = logging.getLogger(__name__)

# 100 us to 10 s, roughly x2.5 per step: resolves a T=1 request on a GPU and a cold CPU batch alike.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


EVICTION_REASONS = ("idle", "budget")  # the label's fixed set
AUDIT_SKIPS = ("busy", "queue_full", "cpu", "too_large")  # why a sampled answer was not audited
LOAD_RESULTS = ("loaded", "refused")
VERSION_STATES = ("READY", "RETIRING", "UNLOADING")
MODEL_LABELS = ("name", "version", "d_model", "n_head", "max_seq_len", "causal", "weights_sha256", "verified")


MODEL_INFO = "mha_model_info"
OWN_FAMILIES = ("mha_", "nv_")  # this server's series, and Triton's that it writes
CallRecord = tuple[str, str, float, str]  # (method, code name, seconds in the server, trace id or "")


class _FoldFirst:
    """The registry's first collector: every read of the registry (a scrape, a test's
    get_sample_value) first applies what the ledger holds and sets the gauges that follow the
    server's state. It exports nothing itself."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[object]:
        return []  # no series of its own, and nothing folded at registration

    def collect(self) -> list[object]:
        self._metrics.refresh()
        return []


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """Observe `values` into a histogram (a child, when it has labels)."""
    for value in values:
        histogram.observe(value)


class _Labelled(Protocol):
    def labels(self, *values: str, **labels: str) -> Gauge: ...

    def remove_by_labels(self, labels: dict[str, str]) -> None: ...


class _WorkerGauge:
    """A labelled gauge of one worker: its `worker` label added to every child."""

    def __init__(self, gauge: Gauge, worker: str) -> None:
        self._gauge, self._worker = gauge, worker

    def labels(self, *values: str, **labels: str) -> Gauge:
        if values:
            return self._gauge.labels(*values, self._worker)
        return self._gauge.labels(**labels, worker=self._worker)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        self._gauge.remove_by_labels(labels)


FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")  # Triton's reason label
REJECTED = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})  # queue full, budget full, draining, loading
CANCELED = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})


def failure_reason(code: str) -> str:
    """Triton's reason for a failed request of final gRPC status `code`."""
    if code in REJECTED:
        return "REJECTED"
    if code in CANCELED:
        return "CANCELED"
    return "BACKEND" if code == "INTERNAL" else "OTHER"


class TritonSeries:
    """Triton's per-model series, by its names, labels (model, version) and units (counts, and
    cumulative microseconds), so that its users' dashboards and alerts read this server: counted
    from the same records as ModelStatistics (docs/operations.md, "Coming from Triton")."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # Triton's names carry no `_total`, which prometheus-client adds to every counter it
        # exposes: these are gauges that only ever grow (PromQL's rate() reads them alike), summed
        # over the workers that ever ran (as counters are), and they pass promtool's lint only
        # where Triton's names do.
        counter = partial(Gauge, registry=registry, multiprocess_mode="sum")
        model = ["model", "version"]
        self.success = counter("nv_inference_request_success", "Number of successful inference requests.", model)
        self.failure = counter(
            "nv_inference_request_failure", "Number of failed inference requests, by reason.", [*model, "reason"]
        )
        self.count = counter("nv_inference_count", "Number of inferences performed (rows; B per request).", model)
        self.executions = counter("nv_inference_exec_count", "Number of model executions (batches).", model)
        us = "Cumulative {} duration in microseconds."
        self.durations = {  # cumulative microseconds, by phase
            phase: counter(f"nv_inference_{name}_duration_us", us.format(what), model)
            for phase, name, what in (
                ("request", "request", "inference request"),
                ("queue", "queue", "inference queuing"),
                ("input", "compute_input", "compute input"),
                ("infer", "compute_infer", "compute inference"),
                ("output", "compute_output", "compute output"),
            )
        }
        self.pending = Gauge(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution.",
            model,
            registry=registry,
            multiprocess_mode="livesum",
        )

    def versioned(self) -> list[Gauge]:
        """Every series here, each labelled by version."""
        return [self.success, self.failure, self.count, self.executions, *self.durations.values(), self.pending]

    def requests(self, model: str, version: str, succeeded: Sequence[float], failed_codes: Sequence[str]) -> None:
        self.success.labels(model, version).inc(len(succeeded))
        self.durations["request"].labels(model, version).inc(sum(succeeded) * 1e6)
        for reason, n in collections.Counter(failure_reason(code) for code in failed_codes).items():
            self.failure.labels(model, version, reason).inc(n)

    def answers(self, model: str, version: str, rows: int, queue_s: float, phases: Sequence[float]) -> None:
        self.count.labels(model, version).inc(rows)
        self.durations["queue"].labels(model, version).inc(queue_s * 1e6)
        for phase, seconds in zip(("input", "infer", "output"), phases, strict=True):
            self.durations[phase].labels(model, version).inc(seconds * 1e6)

    def loaded(self, models: Sequence[str], version: str) -> None:
        """Zero series for a version's entries, so that rates and alerts see them from the start."""
        for model in models:
            for series in (self.success, self.count, self.executions, *self.durations.values()):
                series.labels(model, version)
            for reason in FAILURE_REASONS:
                self.failure.labels(model, version, reason)
            self.pending.labels(model, version).set(0)


class UnloadedVersionsLeave:
    """What `registry` collects, less the series of every model version not loaded for at least
    `grace_s` (loaded: one of its mha_model_info series reads 1), as Triton drops an unloaded
    model's series. A server that follows a repository would otherwise export about a hundred
    series of every version it ever served, for as long as it runs: a worker's multiprocess files
    keep them, those of a worker that died too (whose mha_model_info leaves with it, which is why
    any version a series names counts, not only those mha_model_info names). The grace, counted
    from the first read that finds a version not loaded, lets scrapes read its last counts."""

    def __init__(
        self,
        registry: CollectorRegistry,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        forget: Callable[[str], None] | None = None,
    ):
        """`forget(version)`: drop a version's series from the registry once they have left (the
        supervisor's merge has none to drop: it only leaves them out)."""
        self._registry, self._grace_s, self._clock, self._forget = registry, grace_s, clock, forget
        self._idle_since: dict[str, float] = {}  # version -> when a read first found it not loaded

    def collect(self) -> Iterator[Metric]:
        families = list(self._registry.collect())
        own = [f for f in families if f.name.startswith(OWN_FAMILIES)]  # python_info has a version label too
        gone = self._gone(own)
        for family in own if gone else ():
            family.samples = [s for s in family.samples if s.labels.get("version") not in gone]
        if self._forget is not None:
            for version in gone:  # read without them from the next read on
                self._forget(version)
                del self._idle_since[version]  # named again (a late count), its grace starts anew
        yield from families

    def _gone(self, own: list[Metric]) -> set[str]:
        named = {s.labels["version"] for f in own for s in f.samples if "version" in s.labels}
        loaded = {s.labels["version"] for f in own if f.name == MODEL_INFO for s in f.samples if s.value}
        now = self._clock()
        for version in named - loaded:
            self._idle_since.setdefault(version, now)
        for version in loaded:  # loaded again
            self._idle_since.pop(version, None)
        return {version for version, since in self._idle_since.items() if now - since >= self._grace_s}


def served_registry(
    registry: CollectorRegistry, unloaded_grace_s: float, forget: Callable[[str], None] | None = None
) -> CollectorRegistry:
    """The registry /metrics serves: `registry`'s series, less those of versions long unloaded
    (dropped from `registry` by `forget`, where given)."""
    served = CollectorRegistry(auto_describe=False)
    served.register(UnloadedVersionsLeave(registry, unloaded_grace_s, forget=forget))  # type: ignore[arg-type]
    return served


class VersionSeries:
    """The model's versions: which are loaded (mha_model_info), their states, their sequences,
    and the loads and refusals."""

    def __init__(self, labelled: Callable[[str, str, list[str]], _Labelled], counter: Callable[..., Counter]) -> None:
        self.info = labelled(MODEL_INFO, "Each version of the model loaded (1; 0 once unloaded).", list(MODEL_LABELS))
        self.states = labelled(
            "mha_model_versions", "Versions of the model loaded, by state (READY, RETIRING, UNLOADING).", ["state"]
        )
        self.sequences = labelled("mha_model_version_sequences", "Live sequences held by each version.", ["version"])
        self.loads = counter("mha_model_loads", "Versions loaded, and versions refused by their checks.", ["result"])
        for result in LOAD_RESULTS:
            self.loads.labels(result)

    def loaded(self, model_labels: dict[str, str]) -> None:
        self.info.labels(**{key: model_labels[key] for key in MODEL_LABELS}).set(1)
        self.sequences.labels(model_labels["version"]).set(0)

    def versioned(self) -> list[_Labelled]:
        """The series here labelled by version."""
        return [self.info, self.sequences]

    def unloaded(self, model_labels: dict[str, str]) -> None:
        """A version unloaded: its series read 0, until /metrics leaves them out and the registry
        forgets them (UnloadedVersionsLeave, Metrics.forget)."""
        self.info.labels(**{key: model_labels[key] for key in MODEL_LABELS}).set(0)
        self.sequences.labels(model_labels["version"]).set(0)

    def counted(self, loaded: int, refused: int) -> None:
        self.loads.labels("loaded").inc(loaded)
        self.loads.labels("refused").inc(refused)

    def changed(self, states: Sequence[str]) -> None:
        """The versions loaded, by state (READY, RETIRING, UNLOADING)."""
        for state in VERSION_STATES:
            self.states.labels(state).set(states.count(state))

    def held(self, version: str, live: int) -> None:
        self.sequences.labels(version).set(live)


class AuditSeries:
    """Answers re-verified against the float64 reference (service/engine/audit.py)."""

    def __init__(self, counter: Callable[..., Counter]) -> None:
        self.checked = counter("mha_audit_checked", "Answers recomputed by the float64 reference and compared.")
        self.seconds = counter("mha_audit_seconds", "Time the audit thread spent recomputing answers.")
        self.mismatches = counter(
            "mha_audit_mismatches",
            "Audited answers beyond the precision's tolerance and the format's own error on their input: "
            "each an incident, its backend quarantined.",
            ["backend", "device", "precision"],
        )
        self.skipped = counter("mha_audit_skipped", "Sampled answers not audited, by reason.", ["reason"])
        for reason in AUDIT_SKIPS:
            self.skipped.labels(reason)

    def checked_one(self, seconds: float) -> None:
        self.checked.inc()
        self.seconds.inc(seconds)

    def mismatch(self, backend: str, device: str, precision: str) -> None:
        self.mismatches.labels(backend, device, precision).inc()

    def skipped_one(self, reason: str) -> None:
        self.skipped.labels(reason).inc()


def _gauge(registry: CollectorRegistry, worker: str | None, name: str, documentation: str) -> Gauge:
    """A gauge of this process; a worker's carries its `worker` label."""
    if worker is None:
        return Gauge(name, documentation, registry=registry)
    gauge = Gauge(name, documentation, ["worker"], registry=registry, multiprocess_mode="livemax")
    return gauge.labels(worker=worker)


def _labelled_gauge(
    registry: CollectorRegistry, worker: str | None, name: str, documentation: str, labels: list[str]
) -> _Labelled:
    if worker is None:
        return Gauge(name, documentation, labels, registry=registry)
    gauge = Gauge(name, documentation, [*labels, "worker"], registry=registry, multiprocess_mode="livemax")
    return _WorkerGauge(gauge, worker)


LATENCY = "mha_request_duration_seconds"


class LatencySeries:
    """Time in the server per request, by method; a traced call's trace id rides on its bucket (an
    OpenMetrics exemplar). prometheus-client's multiprocess mode drops exemplars, so a worker of
    several keeps the latest of each bucket itself and writes them to `exemplars` (JSON, replaced
    whole), where the supervisor's /metrics puts them back on the merged buckets."""

    def __init__(self, seconds: Callable[..., Histogram], exemplars: Path | None = None) -> None:
        self.histogram = seconds(LATENCY, "Time in the server per request.", ["method"])
        self._file = exemplars
        self._latest: dict[tuple[str, float], tuple[str, float, float]] = {}  # (method, le) -> (trace, s, when)
        self._written = True

    def traced(self, method: str, seconds: float, trace_id: str) -> None:
        self.histogram.labels(method=method).observe(seconds, {"trace_id": trace_id})
        if self._file is not None:
            le = next((bound for bound in LATENCY_BUCKETS if seconds <= bound), math.inf)
            self._latest[method, le] = (trace_id, seconds, time.time())
            self._written = False

    def write(self) -> None:
        """A worker's exemplars, where the supervisor reads them (only when they changed)."""
        if self._file is None or self._written:
            return
        rows = [[method, le, *latest] for (method, le), latest in self._latest.items()]
        scratch = self._file.with_suffix(".tmp")
        try:
            scratch.write_text(json.dumps(rows))
            os.replace(scratch, self._file)  # a reader sees the old file or the new one, whole
        except OSError as exc:  # exemplars are a convenience: the series themselves go on
            log.warning("latency exemplars not written to %s: %s", self._file, exc)
        self._written = True


class RequestSeries:
    """Requests, and the batches that computed them: counted, timed, sized, and the fallbacks."""

    def __init__(self, registry: CollectorRegistry, counter: Callable[..., Counter], exemplars: Path | None) -> None:
        seconds = partial(Histogram, buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = counter("mha_requests", "Requests answered, by RPC and final code.", ["method", "code"])
        self.latency = LatencySeries(seconds, exemplars)
        version = ["model", "version"]  # the model entry (mha, mha_sequence) and its version that did the work
        self.queue_duration = seconds("mha_queue_duration_seconds", "Time waited for the batch to run.", version)
        self.batch_formation = seconds("mha_batch_formation_seconds", "Time spent forming a batch.", version)
        self.inference_duration = seconds("mha_inference_duration_seconds", "Compute per batch.", ["backend", *version])
        self.batch_size = Histogram(
            "mha_batch_size", "Rows (sum of B) per executed batch.", version, buckets=BATCH_BUCKETS, registry=registry
        )
        self.tokens = counter("mha_tokens", "Tokens served: the sum of B*T over successful requests.", version)
        self.fallbacks = counter(
            "mha_backend_fallbacks", "Batches sent on to the next backend.", ["from", "to", "reason"]
        )

    def versioned(self) -> list[Counter | Histogram]:
        """The series here labelled by version."""
        return [self.queue_duration, self.batch_formation, self.inference_duration, self.batch_size, self.tokens]

    def observe_calls(self, records: Iterable[CallRecord]) -> None:
        """Answered calls, in bulk: counted by method and code, timed by method; a traced call's
        trace id rides on its latency bucket (an OpenMetrics exemplar)."""
        counted: collections.Counter[tuple[str, str]] = collections.Counter()
        timed: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        for method, code, seconds, trace_id in records:
            counted[method, code] += 1
            if trace_id:
                self.latency.traced(method, seconds, trace_id)
            else:
                timed[method].append(seconds)
        for (method, code), n in counted.items():
            self.requests.labels(method=method, code=code).inc(n)
        for method, values in timed.items():
            observe_all(self.latency.histogram.labels(method=method), values)

    def observe_batches(self, events: Sequence[tuple[BatchEvent, str, str]]) -> None:
        """Executed batches, in bulk, each with its model entry and version (failed ones are
        counted by their requests' codes)."""
        by_version: collections.defaultdict[tuple[str, str], list[BatchEvent]] = collections.defaultdict(list)
        for event, model, version in events:
            if event.error is None:
                by_version[model, version].append(event)
        for (model, version), done in by_version.items():
            observe_all(self.batch_size.labels(model, version), [e.rows for e in done])
            observe_all(self.batch_formation.labels(model, version), [e.formation_s for e in done])
            by_backend: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
            for event in done:
                by_backend[event.backend].append(event.compute_s)
            for backend, values in by_backend.items():
                observe_all(self.inference_duration.labels(backend, model, version), values)

    def observe_answers(self, model: str, version: str, tokens: int, queue_s: Sequence[float]) -> None:
        """Answered inference requests of a model entry's version, in bulk: the tokens (B*T) they
        held, the time each queued."""
        self.tokens.labels(model, version).inc(tokens)
        observe_all(self.queue_duration.labels(model, version), queue_s)

    def init_fallbacks(self, chain: list[str], reasons: tuple[str, ...]) -> None:
        """Export zero-valued series for every possible fallback, so rates and alerts see them."""
        for source, target in itertools.pairwise(chain):
            for reason in reasons:
                self.fallbacks.labels(source, target, reason)


class LoadSeries:
    """What the server holds now, and how much it may: requests and bytes in flight, the queue."""

    def __init__(self, gauge: Callable[[str, str], Gauge]) -> None:
        self.inflight = gauge("mha_inflight_requests", "Inference requests in the server now.")
        self.queue_depth = gauge("mha_queue_depth", "Requests waiting in the batching queue.")
        self.inflight_bytes = gauge("mha_inflight_bytes", "Bytes of requests and answers held now.")
        self.inflight_budget = gauge("mha_inflight_budget_bytes", "Bytes held at most before RESOURCE_EXHAUSTED.")
        self.queue_capacity = gauge("mha_queue_capacity", "Requests the queue holds before RESOURCE_EXHAUSTED.")


class ServingSeries:
    """What serves now and on what terms: the load held, readiness, the backends serving, the
    device required, the certificate served. Gauges of this process (a worker's carry its label)."""

    def __init__(
        self, gauge: Callable[[str, str], Gauge], labelled: Callable[[str, str, list[str]], _Labelled]
    ) -> None:
        self.load = LoadSeries(gauge)
        self.ready = gauge("mha_ready", "1 when the model is loaded, self-checked and serving.")
        self.backend_info = labelled(
            "mha_backend_info",
            "1 for each backend serving now (light and heavy batches may have their own), 0 for fallbacks.",
            ["backend", "device"],
        )
        self.device_required = labelled(
            "mha_device_required", "1 for the device this server must serve on (--require-device).", ["device"]
        )
        self.tls_expiry = gauge(
            "mha_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate served to new connections expires, in Unix time; 0 without TLS.",
        )
        self.files_refused = labelled(
            "mha_watched_files_refused",
            "1 while the last change of these files (tls, tokens) could not be taken: the ones before are served.",
            ["files"],
        )

    def set_backends(self, serving: list[tuple[str, str]], loaded: list[tuple[str, str]]) -> None:
        for name, device in loaded:
            self.backend_info.labels(backend=name, device=device).set(1 if (name, device) in serving else 0)


class SequenceSeries:
    """The live sequences: how many, their bytes, their limits, and the evictions."""

    def __init__(self, gauge: Callable[[str, str], Gauge], counter: Callable[..., Counter]) -> None:
        self.active = gauge("mha_sequences_active", "Live sequences whose keys and values are kept.")
        self.state_bytes = gauge("mha_sequence_state_bytes", "Bytes of the live sequences' keys and values.")
        self.capacity = gauge("mha_sequences_capacity", "Live sequences the server keeps (--max-sequences).")
        self.state_budget = gauge(
            "mha_sequence_state_budget_bytes", "Bytes the live sequences' state may take (--max-sequence-state-mb)."
        )
        self.evictions = counter(
            "mha_sequence_evictions", "Live sequences evicted, by reason (idle timeout, state budget).", ["reason"]
        )
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)

    def limits(self, sequences: int, state_bytes: int) -> None:
        self.capacity.set(sequences)
        self.state_budget.set(state_bytes)

    def changed(self, active: int, state_bytes: int, evicted: str | None) -> None:
        self.active.set(active)
        self.state_bytes.set(state_bytes)
        if evicted is not None:
            self.evictions.labels(evicted).inc()


class Metrics:
    """Every series the service exports, by what they describe; names are a public interface
    (dashboards, alerts). What requests leave is written in `ledger` and applied in bulk before
    each read (`refresh`), with the gauges that follow the server's state.

    A worker of several (`worker` set) writes prometheus-client's multiprocess files (the
    supervisor sets PROMETHEUS_MULTIPROC_DIR for it and merges them): its gauges carry a `worker`
    label and leave the merge when it dies; counters and histograms add up over every worker that
    ever ran. Nobody reads a worker's registry then, so it refreshes on a timer (server.py)."""

    def __init__(self, registry: CollectorRegistry, worker: int | None = None, exemplars: Path | None = None) -> None:
        """`exemplars`: where a worker of several writes its latency exemplars."""
        _disable_created()
        self.registry = registry
        self.ledger = Ledger()
        registry.register(_FoldFirst(self))  # type: ignore[arg-type]  # first: it folds before the rest
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*: memory, CPU
            registry.register(collector)
        counter = partial(Counter, registry=registry)
        label = None if worker is None else str(worker)
        gauge, labelled = partial(_gauge, registry, label), partial(_labelled_gauge, registry, label)
        self.requests = RequestSeries(registry, counter, exemplars)
        self.serving = ServingSeries(gauge, labelled)
        self.sequences = SequenceSeries(gauge, counter)
        self.versions = VersionSeries(labelled, counter)
        self.triton, self.audit = TritonSeries(registry), AuditSeries(counter)
        if worker is not None:  # the files keep what forget() drops: by design (Metrics.forget)
            warnings.filterwarnings("ignore", "Removal of labels has not been implemented", UserWarning)

    def forget(self, version: str) -> None:
        """Drop every series of model version `version` from the registry, once /metrics has left
        it out for the grace (UnloadedVersionsLeave): a server that follows a repository would
        otherwise hold every version it ever served, and collect them all at each read (at 1,000
        versions, 0.39 s a read on the event loop, and 77 MiB: docs/benchmarks.md). A lone
        server counts a version loaded again from zero (a counter reset, to Prometheus). A
        worker's multiprocess files keep the values (prometheus-client removes nothing from them,
        and warns so), which the supervisor's merge leaves out; loaded again, the version counts
        on from them."""
        for series in (*self.triton.versioned(), *self.requests.versioned(), *self.versions.versioned()):
            series.remove_by_labels({"version": version})

    def follow(self, gauge: Gauge, value: Callable[[], float]) -> None:
        """Set `gauge` to `value()` whenever the metrics are read (or refreshed)."""
        self.ledger.after_fold(lambda: gauge.set(value()))

    def on_refresh(self, update: Callable[[], None]) -> None:
        """Call `update` whenever the metrics are read (or refreshed): gauges of changing label sets."""
        self.ledger.after_fold(update)

    def refresh(self) -> None:
        """Apply what the ledger holds, and set the gauges that follow the server's state; a
        worker's exemplars written."""
        self.ledger.fold()
        self.requests.latency.write()
