"""What the core makes known as it serves: every executed batch (stateless or decode steps) and
every answered request into the metrics and the model's statistics (written in the metrics'
ledger, applied in bulk before they are read), the active backend into mha_backend_info (and
readiness under --require-device), fallbacks as they happen. No serving decisions here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from service.backends.chain import BackendChain
from service.batch_engine import Timing
from service.batching import BatchEvent
from service.deferred import after_answer
from service.engine.readiness import DeviceHealth
from service.engine.stats import ModelStats
from service.metrics import Metrics
from service.tracing import Tracing


class ServingBackends:
    """The backends serving now, as mha_backend_info and readiness under --require-device see
    them, and the device's health as batches report it."""

    def __init__(
        self, metrics: Metrics, device: DeviceHealth, serving_ok: Callable[[], bool], device_lost: Callable[[], None]
    ) -> None:
        self.metrics, self.device = metrics, device
        self._serving_ok, self._device_lost = serving_ok, device_lost
        self._serving: list[tuple[str, str]] = []  # the backends mha_backend_info last showed as serving
        self._health_seen = -1  # the chain's quarantine.changes when the serving backends were last looked at

    def observe(self, error: BaseException) -> None:
        """A batch's error: a sticky device error stops the server (DeviceHealth) at once."""
        if self.device.observe(error):
            self._device_lost()

    def may_have_changed(self, chain: BackendChain) -> bool:
        """While a backend is quarantined, or its health changed since the last look."""
        return chain.quarantine.changes != self._health_seen or chain.quarantine.any

    def show(self, chain: BackendChain) -> None:
        """The serving backends (the active one, and the light batches' where they have their
        own), once they change: mha_backend_info, and readiness on the required device."""
        self._health_seen = chain.quarantine.changes
        serving = [(b.name, b.device) for b in chain.serving()]
        if serving != self._serving:
            self._serving = serving
            self.device.serving_changed(self._serving_ok())
            self.metrics.serving.set_backends(serving, [(b.name, b.device) for b in chain.backends])


class Publisher:
    def __init__(
        self,
        metrics: Metrics,
        serving: ServingBackends,
        tracing: Tracing,
        entries: tuple[str, str] = ("mha", "mha_sequence"),
    ) -> None:
        self.metrics, self.serving, self.tracing = metrics, serving, tracing
        self.entries = entries  # the model names of the stateless requests and of the decode steps
        self._stats: dict[tuple[str, bool], ModelStats] = {}  # (version, steps): each version's, each entry's
        self._batches = metrics.ledger.book(self._fold_batches)
        self._answers = metrics.ledger.book(self._fold_answers)  # (tokens, rows, Timing, wall s)

    def fallback(self, source: str, target: str, reason: str) -> None:
        self.metrics.requests.fallbacks.labels(source, target, reason).inc()

    def stats(self, version: str, steps: bool = False) -> ModelStats:
        """The statistics of `version`: of the stateless model, or (`steps`) of the sequence model."""
        key = (version, steps)
        if key not in self._stats:
            self._stats[key] = ModelStats()
        return self._stats[key]

    def forget(self, version: str) -> None:
        """A version's statistics go, with its series (Metrics.forget), once it has been unloaded
        for the metrics' grace: no statistics answer names it, and a server that follows a
        repository would keep two entries (about 4 KB each) of every version it ever served."""
        for steps in (False, True):
            self._stats.pop((version, steps), None)

    def batch(self, event: BatchEvent, chain: BackendChain, version: str, steps: bool = False) -> None:
        """A batch, of stateless requests or decode steps: a sticky device error in it stops the
        server (DeviceHealth) at once; it is written in the ledger; the serving backends are
        looked at again, and its trace reported, after the batch's answers have gone
        (after_answer), when they may have changed: while a backend is quarantined or its health
        changed since the last look, not otherwise."""
        if event.error is not None:
            self.serving.observe(event.error)
        self._batches.add((event, version, steps))
        if event.traced or self.serving.may_have_changed(chain):
            after_answer(self._published, event, chain)

    def _published(self, event: BatchEvent, chain: BackendChain) -> None:
        self.serving.show(chain)
        if event.traced:  # tracing on, and a traced request in the batch
            preferred = chain.order_for(event.rows, max(event.seqs))[0].name
            fallback = f"{preferred} -> {event.backend}" if event.backend and event.backend != preferred else ""
            self.tracing.report_batch(event, fallback)

    def answered(self, shape: tuple[int, ...], timing: Timing, version: str, steps: bool = False) -> None:
        """A request of `shape` (B, T, C) answered: its tokens, its wait and its batch's compute."""
        rows = int(shape[0])
        self._answers.add((rows * int(shape[1]), rows, timing, time.time(), version, steps))

    @contextmanager
    def statistics(self, version: str, steps: bool = False) -> Iterator[ModelStats]:
        """A version's statistics (of the stateless model; `steps`: of the sequence model) with
        every record applied, held still while the caller reads."""
        with self.metrics.ledger.folded():
            yield self.stats(version, steps)

    def requests_closed(self, records: Iterable[tuple[str, bool, str, float]], latest: str) -> None:
        """Closed inference calls (version, step, code, seconds) into their version's statistics
        and Triton's request counters (a request refused before it reached a version: `latest`'s)."""
        grouped: dict[tuple[str, bool], list[tuple[str, float]]] = {}
        for version, step, code, s in records:
            grouped.setdefault((version or latest, step), []).append((code, s))
        for (version, step), done in grouped.items():
            ok_s, failed_s = [s for c, s in done if c == "OK"], [s for c, s in done if c != "OK"]
            self.stats(version, step).observe_requests(ok_s, failed_s)
            self.metrics.triton.requests(self.entry(step), version, ok_s, [c for c, _ in done if c != "OK"])

    def entry(self, steps: bool) -> str:
        return self.entries[1] if steps else self.entries[0]

    def _fold_batches(self, records: list[tuple[BatchEvent, str, bool]]) -> None:
        self.metrics.requests.observe_batches(
            [(event, self.entry(steps), version) for event, version, steps in records]
        )
        executions = self.metrics.triton.executions
        for event, version, steps in records:
            self.stats(version, steps).observe_batch(event)
            if event.error is None:
                executions.labels(self.entry(steps), version).inc()

    def _fold_answers(self, answers: list[tuple[int, int, Timing, float, str, bool]]) -> None:
        tokens, rows, timings, answered_at, versions, kinds = zip(*answers, strict=True)
        for key in set(zip(versions, kinds, strict=True)):
            mine = [i for i, other in enumerate(zip(versions, kinds, strict=True)) if other == key]
            last_ms = int(max(answered_at[i] for i in mine) * 1e3)
            held, answered_rows = [timings[i] for i in mine], sum(rows[i] for i in mine)
            self.stats(*key).observe_answers(answered_rows, held, last_ms)
            version, steps = key
            queued = [t.queue_s for t in held]
            self.metrics.requests.observe_answers(self.entry(steps), version, sum(tokens[i] for i in mine), queued)
            phases = [sum(t.compute[k] for t in held) for k in range(3)]
            self.metrics.triton.answers(self.entry(steps), version, answered_rows, sum(queued), phases)
