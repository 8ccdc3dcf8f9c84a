"""What the core makes known as it serves: every executed batch (stateless or decode steps) and
every answered request into the metrics and the model's statistics, the active backend into
mha_backend_info (and readiness under --require-device), fallbacks as they happen. No serving
decisions here."""

from __future__ import annotations

from collections.abc import Callable

from service.backends import BackendChain
from service.batching import BatchEvent
from service.deferred import after_answer
from service.engine.readiness import DeviceHealth
from service.engine.stats import ModelStats
from service.metrics import Metrics
from service.tracing import Tracing


class Publisher:
    def __init__(
        self,
        metrics: Metrics,
        stats: ModelStats,
        device: DeviceHealth,
        serving_ok: Callable[[], bool],
        device_lost: Callable[[], None],
        tracing: Tracing | None = None,
    ) -> None:
        self.metrics, self.stats, self.device = metrics, stats, device
        self.tracing = tracing or Tracing()
        self._serving_ok, self._device_lost = serving_ok, device_lost
        self._serving: list[tuple[str, str]] = []  # the backends mha_backend_info last showed as serving

    def fallback(self, source: str, target: str, reason: str) -> None:
        self.metrics.fallbacks.labels(source, target, reason).inc()

    def batch(self, event: BatchEvent, chain: BackendChain) -> None:
        """A stateless batch: a sticky device error in it stops the server (DeviceHealth) at once;
        the rest is published after the batch's answers have gone (after_answer)."""
        if self.device.observe(event.error):
            self._device_lost()
        after_answer(self._published, event, chain)

    def _published(self, event: BatchEvent, chain: BackendChain) -> None:
        self._recorded(event)
        self.backends(chain)
        if event.traced:  # tracing on, and a traced request in the batch
            preferred = chain.order_for(event.rows, max(event.seqs))[0].name
            fallback = f"{preferred} -> {event.backend}" if event.backend and event.backend != preferred else ""
            self.tracing.report_batch(event, fallback)

    def steps(self, event: BatchEvent) -> None:
        """A batch of decode steps, published after its answers have gone (its lost device is
        handled where the step fails)."""
        after_answer(self._recorded, event)

    def _recorded(self, event: BatchEvent) -> None:
        """A batch, in the batch metrics and statistics."""
        self.metrics.observe_batch(event)
        self.stats.observe_batch(event)

    def answered(self, shape: tuple[int, ...], queue_s: float) -> None:
        """A request of `shape` (B, T, C) answered after `queue_s` in the queue: its tokens and wait."""
        self.metrics.observe_answer(int(shape[0]) * int(shape[1]), queue_s)
        self.stats.observe_answer(int(shape[0]), queue_s)

    def backends(self, chain: BackendChain) -> None:
        """The serving backends (the active one, and the light batches' where they have their
        own), once they change: mha_backend_info, and readiness on the required device."""
        serving = [(b.name, b.device) for b in chain.serving()]
        if serving != self._serving:
            self._serving = serving
            self.device.serving_changed(self._serving_ok())
            self.metrics.set_backends(serving, [(b.name, b.device) for b in chain.backends])
