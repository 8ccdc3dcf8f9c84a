"""Prometheus metrics on an injected CollectorRegistry (no global state, no `_created` series)."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client import disable_created_metrics as _disable_created

from service.batching import BatchEvent
from service.ledger import Ledger

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


CallRecord = tuple[str, str, float, str]  # (method, code name, seconds in the server, trace id or "")


class _FoldFirst:
    """The registry's first collector: every read of the registry (a scrape, a test's
    get_sample_value) first applies what the ledger holds. It exports nothing itself."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def describe(self) -> list[object]:
        return []  # no series of its own, and nothing folded at registration

    def collect(self) -> list[object]:
        self._ledger.fold()
        return []


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """Observe `values` at once into a histogram (a child, when it has labels): each bucket's
    count and the sum grow once, where prometheus-client's observe() takes a lock per bucket
    and value. It reaches into the histogram's bucket values (pinned prometheus-client; the
    exposition is tested against observe()'s)."""
    if not values:
        return
    bounds = histogram._upper_bounds  # ascending, +Inf last: bucket i counts values <= bounds[i]
    index = np.minimum(np.searchsorted(bounds, values, side="left"), len(bounds) - 1)  # NaN: +Inf's
    counts = np.bincount(index, minlength=len(bounds))
    histogram._sum.inc(math.fsum(values))
    for i in np.flatnonzero(counts):
        histogram._buckets[i].inc(int(counts[i]))


class Metrics:
    """Every series the service exports; names are a public interface (dashboards, alerts).
    What requests leave is written in `ledger` and applied in bulk before each read."""

    def __init__(self, registry: CollectorRegistry) -> None:
        _disable_created()
        self.registry = registry
        self.ledger = Ledger()
        registry.register(_FoldFirst(self.ledger))  # type: ignore[arg-type]  # first: it folds before the rest
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*: memory, CPU
            registry.register(collector)
        seconds = partial(Histogram, buckets=LATENCY_BUCKETS, registry=registry)
        counter, gauge = partial(Counter, registry=registry), partial(Gauge, registry=registry)
        self.requests = counter(
            "mha_requests", "Requests answered, by RPC method and final gRPC code.", ["method", "code"]
        )
        self.request_duration = seconds("mha_request_duration_seconds", "Time in the server per request.", ["method"])
        self.queue_duration = seconds("mha_queue_duration_seconds", "Time a request waited for its batch to run.")
        self.batch_formation = seconds("mha_batch_formation_seconds", "Time the batcher spent forming a batch.")
        self.inference_duration = seconds("mha_inference_duration_seconds", "Compute time per batch.", ["backend"])
        self.batch_size = Histogram(
            "mha_batch_size", "Rows (sum of B) per executed batch.", buckets=BATCH_BUCKETS, registry=registry
        )
        self.tokens = counter("mha_tokens", "Tokens served: the sum of B*T over successful requests.")
        self.inflight = gauge("mha_inflight_requests", "Inference requests in the server now.")
        self.queue_depth = gauge("mha_queue_depth", "Requests waiting in the batching queue.")
        self.queue_capacity = gauge("mha_queue_capacity", "Requests the queue holds before RESOURCE_EXHAUSTED.")
        self.fallbacks = counter(
            "mha_backend_fallbacks",
            "Batches sent on to the next backend, by from, to and reason.",
            ["from", "to", "reason"],
        )
        self.backend_info = gauge(
            "mha_backend_info",
            "1 for each backend serving now (light and heavy batches may have their own), 0 for fallbacks.",
            ["backend", "device"],
        )
        self.model_info = Info("mha_model", "The model being served.", registry=registry)
        self.ready = gauge("mha_ready", "1 when the model is loaded, self-checked and serving.")
        self.device_required = gauge(
            "mha_device_required", "1 for the device this server must serve on (--require-device).", ["device"]
        )
        self.sequences_active = gauge("mha_sequences_active", "Live sequences whose keys and values are kept.")
        self.sequence_state_bytes = gauge("mha_sequence_state_bytes", "Bytes of the live sequences' keys and values.")
        self.sequences_capacity = gauge("mha_sequences_capacity", "Live sequences the server keeps (--max-sequences).")
        self.sequence_state_budget = gauge(
            "mha_sequence_state_budget_bytes", "Bytes the live sequences' state may take (--max-sequence-state-mb)."
        )
        self.sequence_evictions = counter(
            "mha_sequence_evictions", "Live sequences evicted, by reason (idle timeout, state budget).", ["reason"]
        )
        for reason in EVICTION_REASONS:
            self.sequence_evictions.labels(reason)

    def sequence_limits(self, sequences: int, state_bytes: int) -> None:
        self.sequences_capacity.set(sequences)
        self.sequence_state_budget.set(state_bytes)

    def sequences_changed(self, active: int, state_bytes: int, evicted: str | None) -> None:
        self.sequences_active.set(active)
        self.sequence_state_bytes.set(state_bytes)
        if evicted is not None:
            self.sequence_evictions.labels(evicted).inc()

    def loaded(self, model_labels: dict[str, str], queue_capacity: int, queue_depth: Callable[[], int]) -> None:
        self.model_info.info(model_labels)
        self.queue_capacity.set(queue_capacity)
        self.queue_depth.set_function(queue_depth)

    def observe_calls(self, records: Iterable[CallRecord]) -> None:
        """Answered calls, in bulk: counted by method and code, timed by method; a traced call's
        trace id rides on its latency bucket (an OpenMetrics exemplar)."""
        counted: collections.Counter[tuple[str, str]] = collections.Counter()
        timed: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        for method, code, seconds, trace_id in records:
            counted[method, code] += 1
            if trace_id:
                self.request_duration.labels(method=method).observe(seconds, {"trace_id": trace_id})
            else:
                timed[method].append(seconds)
        for (method, code), n in counted.items():
            self.requests.labels(method=method, code=code).inc(n)
        for method, values in timed.items():
            observe_many(self.request_duration.labels(method=method), values)

    def observe_batches(self, events: Sequence[BatchEvent]) -> None:
        """Executed batches, in bulk (failed ones are counted by their requests' codes)."""
        done = [e for e in events if e.error is None]
        observe_many(self.batch_size, [e.rows for e in done])
        observe_many(self.batch_formation, [e.formation_s for e in done])
        by_backend: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        for event in done:
            by_backend[event.backend].append(event.compute_s)
        for backend, values in by_backend.items():
            observe_many(self.inference_duration.labels(backend=backend), values)

    def observe_answers(self, tokens: int, queue_s: Sequence[float]) -> None:
        """Answered inference requests, in bulk: the tokens (B*T) they held, the time each queued."""
        self.tokens.inc(tokens)
        observe_many(self.queue_duration, queue_s)

    def init_fallbacks(self, chain: list[str], reasons: tuple[str, ...]) -> None:
        """Export zero-valued series for every possible fallback, so rates and alerts see them."""
        for source, target in itertools.pairwise(chain):
            for reason in reasons:
                self.fallbacks.labels(source, target, reason)

    def set_backends(self, serving: list[tuple[str, str]], loaded: list[tuple[str, str]]) -> None:
        for name, device in loaded:
            self.backend_info.labels(backend=name, device=device).set(1 if (name, device) in serving else 0)
