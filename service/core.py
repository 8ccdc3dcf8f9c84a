"""The inference core: model state, the batcher in front of the backend chain, statistics.

Speaks numpy, not protobuf. The servicer calls `infer`; the batcher calls the chain on a worker
thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from model import MHAConfig
from model.checkpoint import CheckpointError, load_checkpoint
from service.backends import BackendChain, Selection, select_backends
from service.backends.chain import REASONS
from service.batcher import Batcher, BatcherConfig, Timing
from service.codec import ModelSpec
from service.errors import NotReady
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class ModelStats:
    """What ModelStatistics reports, Triton's way."""

    last_inference_ms: int = 0
    inference_count: int = 0  # rows served
    execution_count: int = 0  # batches executed
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=dict)  # rows -> compute


class ModelLoadError(RuntimeError):
    """The model directory cannot be served; the message says why."""


@dataclass
class LoadedModel:
    directory: Path
    config: MHAConfig
    selection: Selection
    chain: BackendChain


class InferenceCore:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = State.LOADING
        self.stats = ModelStats()
        self.model: LoadedModel | None = None
        self.batcher: Batcher | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer")
        self.in_flight = 0  # inference requests in the server (the batcher waits only for these)
        metrics.inflight.set_function(lambda: self.in_flight)
        self._published_active: str | None = None  # the backend mha_backend_info last showed as active

    def _set_state(self, state: State) -> None:
        self.state = state
        self.metrics.ready.set(1 if state is State.READY else 0)

    @property
    def spec(self) -> ModelSpec:
        if self.model is None:
            raise NotReady("the model is still loading; retry shortly")
        config = self.model.config
        return ModelSpec(
            name=self.settings.model_name,
            version=self.settings.model_version,
            input_name="x",
            output_name="y",
            d_model=config.d_model,
            max_seq_len=config.max_seq_len,
            max_request_rows=self.settings.max_request_rows,
        )

    async def load(self) -> None:
        """Load, self-check and order the backends off the event loop, then start batching."""
        try:
            self.model = await asyncio.get_running_loop().run_in_executor(self._executor, self._load_blocking)
        except Exception:
            self._set_state(State.FAILED)
            raise
        config = self.model.config
        self.batcher = Batcher(
            BatcherConfig(
                max_batch_size=self.settings.max_batch_size,
                max_queue_delay_s=self.settings.max_queue_delay_ms / 1e3,
                max_queue_size=self.settings.max_queue_size,
                max_padding_ratio=self.settings.max_padding_ratio,
                causal=config.causal,
            ),
            run_batch=self._run_batch,
            executor=self._executor,
            on_batch=self._on_batch,
            in_flight=lambda: self.in_flight,
        )
        self.batcher.start()
        batcher = self.batcher
        self.metrics.queue_depth.set_function(lambda: batcher.depth)
        self.metrics.model_info.info(
            {
                "name": self.settings.model_name,
                "version": self.settings.model_version,
                "d_model": str(config.d_model),
                "n_head": str(config.n_head),
                "max_seq_len": str(config.max_seq_len),
                "causal": str(config.causal).lower(),
            }
        )
        self.metrics.queue_capacity.set(self.settings.max_queue_size)
        self.metrics.init_fallbacks([b.name for b in self.model.chain.backends], REASONS)
        self._publish_backends()
        self._set_state(State.READY)

    def _load_blocking(self) -> LoadedModel:
        directory = resolve_model_dir(self.settings)
        try:
            config, weights = load_checkpoint(directory / "weights.safetensors")
        except CheckpointError as exc:
            raise ModelLoadError(f"cannot serve {directory}: {exc}") from exc
        selection = select_backends(
            directory, config, weights, requested=self.settings.backend, threads=self.settings.cpu_threads
        )
        if not selection.backends:
            raise ModelLoadError(f"no backend can serve {directory}: {selection.summary()}")
        chain = BackendChain(
            selection.backends,
            probe=selection.check.passes,
            failure_threshold=self.settings.fallback_failures,
            cooldown_s=self.settings.fallback_cooldown_s,
            on_fallback=self._on_fallback,
        )
        active = selection.backends[0]
        log.info("serving %s with %s on %s; %s", directory, active.name, active.device, selection.summary())
        return LoadedModel(directory=directory, config=config, selection=selection, chain=chain)

    def _run_batch(self, x: np.ndarray) -> tuple[np.ndarray, str]:
        if self.model is None:
            raise NotReady("the model is not loaded")
        y, backend = self.model.chain.run(x)
        return y, backend.name

    def _on_fallback(self, source: str, target: str, reason: str) -> None:
        self.metrics.fallbacks.labels(source, target, reason).inc()

    def _on_batch(self, rows: int, formation_s: float, compute_s: float, backend: str) -> None:
        self.metrics.batch_size.observe(rows)
        self.metrics.batch_formation.observe(formation_s)
        self.metrics.inference_duration.labels(backend=backend).observe(compute_s)
        self.stats.execution_count += 1
        self.stats.compute_infer.add(compute_s)
        self.stats.batches.setdefault(rows, Duration()).add(compute_s)
        self._publish_backends()

    def _publish_backends(self) -> None:
        if self.model is None:
            return
        active = self.model.chain.active
        if active.name == self._published_active:
            return
        self._published_active = active.name
        self.metrics.set_backends((active.name, active.device), [(b.name, b.device) for b in self.model.chain.backends])

    async def infer(self, x: np.ndarray, deadline: float | None) -> tuple[np.ndarray, Timing]:
        """(B, T, C) -> (B, T, C) through the queue; `deadline` is time.monotonic() based."""
        if self.state is State.DRAINING:
            raise NotReady("the server is draining for shutdown; retry on another replica")
        if self.state is not State.READY or self.batcher is None:
            raise NotReady(f"the model is not ready (state: {self.state.value}); retry shortly")
        y, timing = await self.batcher.submit(x, deadline)
        self.metrics.queue_duration.observe(timing.queue_s)
        self.metrics.tokens.inc(int(x.shape[0]) * int(x.shape[1]))
        self.stats.inference_count += int(x.shape[0])
        self.stats.queue.add(timing.queue_s)
        self.stats.last_inference_ms = int(time.time() * 1e3)
        return y, timing

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1

    def record_outcome(self, ok: bool, seconds: float) -> None:
        (self.stats.success if ok else self.stats.fail).add(seconds)

    def start_draining(self) -> None:
        if self.state is not State.DRAINING:
            log.info("draining: new requests are refused, in-flight requests finish")
            self._set_state(State.DRAINING)

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        self._executor.shutdown(wait=True)
        if self.model is not None:
            for backend in self.model.chain.backends:
                backend.close()


def resolve_model_dir(settings: Settings) -> Path:
    """The directory to serve; the default model is exported first if it is missing."""
    if settings.model_dir is not None:
        directory = settings.model_dir
        if not (directory / "weights.safetensors").is_file():
            raise ModelLoadError(
                f"{directory} has no weights.safetensors; create it with `mha export --out {directory}`"
            )
        return directory
    directory = settings.default_model_dir
    if not (directory / "weights.safetensors").is_file():
        log.info("no default model in %s: exporting it (seed 0, default config)", directory)
        from export.pipeline import export_model_dir
        from model.checkpoint import init_weights

        config = MHAConfig()
        export_model_dir(directory, config, init_weights(config, seed=0))
    return directory
