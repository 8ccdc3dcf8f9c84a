"""The inference core: model state, the batcher in front of the backend chain, statistics.

Speaks numpy, not protobuf. The servicer calls `infer`; the batcher calls the chain on a worker
thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from export.layout import ModelFiles, precision_file
from export.verify import check_manifest, sha256_file
from model import MHAConfig
from model.checkpoint import CheckpointError, load_checkpoint
from service.backends import BackendChain, BackendSpec, Selection, select_backends
from service.backends.chain import REASONS, FallbackHook
from service.batch_engine import Timing
from service.batching import BatcherConfig, Clock, MonotonicClock
from service.budget import MIB, InflightBudget
from service.decode.control import SequenceControl
from service.decode.scheduler import Decoder, StepBatcher, StepInput
from service.decode.sequences import SequenceLimits, SequenceStore
from service.engine.audit import AuditLimits, Auditor, Reference, Sample, mismatch_message
from service.engine.batcher import Batcher
from service.engine.inflight import InFlight
from service.engine.loading import LoadReport, VersionLoader
from service.engine.publishing import Publisher
from service.engine.readiness import DeviceHealth
from service.engine.served import ModelIdentity, ServedModel, Serving
from service.engine.sources import ModelSource, PolicyReader
from service.engine.versions import Loaded, Versions
from service.errors import DeviceLost, FeatureOff, NotReady
from service.metrics import Metrics
from service.numerics import magnitude_bound, refuse_non_finite
from service.resources import memory_limit_bytes
from service.scheduling import SchedulePolicy
from service.settings import Settings, schedule_policy
from service.tracing import Tracing

log = logging.getLogger(__name__)
Queue = tuple[int, float | None]  # a request's (priority, queue timeout in seconds) under the schedule policy


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class ModelLoadError(RuntimeError):
    """The model directory cannot be served; the message says why."""


# Called on the computing thread before every batch (kind "batch", its merged input) and every batch
# of decode steps ("steps", each step's new tokens): it may block, or raise as a failing compute
# would. None in production.
ComputeHook = Callable[[str, Sequence[np.ndarray]], None]


class InferenceCore:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        clock: Clock | None = None,
        tracing: Tracing | None = None,
        compute_hook: ComputeHook | None = None,
        source: ModelSource | None = None,
        schedule: SchedulePolicy | None = None,
    ) -> None:
        self.settings = settings
        self.schedule = schedule or schedule_policy(settings)  # the stateless model's priorities and queue policies
        self.compute_hook = compute_hook  # tests hold computes and inject failures with it (ComputeHook)
        self.tracing = tracing or Tracing()  # off unless the app turned it on
        self.metrics = metrics
        self.clock: Clock = clock or MonotonicClock()  # the batcher's; request deadlines are converted to it
        self.identity = _identity(settings)  # known before loading
        self.state = State.LOADING
        self.requests = InFlight()  # inference requests in the server (the batchers wait only for these)
        self.budget = InflightBudget(_inflight_limit(settings))  # bytes of requests and answers held at once
        self.draining = asyncio.Event()  # set once draining began: open streams stop reading
        self.versions = Versions(settings.model_name)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer")  # every version's batches
        self.device = DeviceHealth(settings.require_device, metrics)  # the server's health follows serving_ok()
        failed = partial(self.set_state, State.FAILED)
        entries = (self.identity.name, self.identity.sequence_name)
        self.publish = Publisher(metrics, self.device, self.serving_ok, failed, self.tracing, entries)
        self.location: dict[str, int | str] = {"replica": settings.replica, "worker": settings.worker_index}
        self.keeper = VersionKeeper(self, source or single_source(settings))
        self.loader = self.keeper.loader
        self.audit = Auditor(_audit_limits(settings), partial(_audited, self), metrics.audit.skipped_one)
        _follow(metrics, self)

    @property
    def loaded(self) -> Loaded:
        """The latest version serving."""
        latest = self.versions.latest()
        if latest is None:
            if self.state is State.LOADING:
                raise NotReady("the model is still loading; retry shortly")
            raise NotReady(f"no version of model {self.identity.name!r} is loaded; retry once one is")
        return latest

    def serving(self, loaded: Loaded | None = None) -> Serving:
        return _serving(loaded or self.loaded, self.settings, self.schedule)

    def set_state(self, state: State) -> None:
        self.state = state

    async def load(self) -> None:
        """Load the versions the source names (in explicit mode only with --load-model), then serve."""
        await self.keeper.load_at_start()

    def serving_ok(self) -> bool:
        """Ready for traffic: loaded, and on the required device (--require-device) if any. The one
        source of readiness: gRPC ServerReady and ModelReady, HTTP /v2/health/ready and the
        model's /ready, mha_ready and the health service all ask it."""
        latest = self.versions.latest()
        return self.state is State.READY and latest is not None and self.device.allows(latest.chain.active)

    def readiness(self) -> str:
        """Why the server is not ready ("" when it is), for the clients' messages."""
        if self.serving_ok():
            return ""
        if self.state is State.READY and (latest := self.versions.latest()) is not None:
            active = latest.chain.active
            return f"--require-device {self.settings.require_device}, but {active.name} on {active.device} serves"
        if self.state is State.READY:
            return f"no version of model {self.identity.name!r} is loaded"
        return f"the model is not ready (state: {self.state.value})"

    def route(self, control: SequenceControl | None, version: str) -> Loaded:
        """The version a request goes to: the one it names, else the latest; a sequence's later
        steps to the version it began on."""
        self.check_ready()
        return self.versions.for_request(version) if control is None else self.versions.for_step(control, version)

    async def infer(
        self, x: np.ndarray, deadline: float | None, loaded: Loaded, queue: Queue = (0, None), request_id: str = ""
    ) -> tuple[np.ndarray, Timing]:
        """(B, T, C) -> (B, T, C) through `loaded`'s queue; `deadline` is on `self.clock`; `queue`
        the request's (priority, timeout in seconds) under the schedule policy."""
        loaded.model.check_magnitude(x)
        y, timing = await loaded.batcher.submit(x, deadline, *queue)
        if not timing.finite:  # the chain found this input to blame (BackendChain)
            refuse_non_finite(x, y)
        self.publish.answered(x.shape, timing, loaded.version)
        self.audit.offer(x, y, timing.backend, request_id, loaded)  # sampled, checked off the hot path
        return y, timing

    async def step(
        self, control: SequenceControl, x: np.ndarray, loaded: Loaded, deadline: float | None = None
    ) -> tuple[np.ndarray, Timing, int]:
        """A decode step of a live sequence: (B, t, C) new tokens -> their (B, t, C) outputs, and
        the tokens the sequence holds after the step."""
        if loaded.chain.steps_device is None:
            raise FeatureOff(
                "no backend of this server computes decode steps: its model directory has no step.onnx and "
                "PyTorch is not among --backend's; re-export the model with `mha export`, or send whole sequences"
            )
        loaded.model.check_magnitude(x)  # the cached keys and values were checked with their own steps
        try:
            with self.tracing.step(control.label, int(x.shape[1])) as span:
                stepped = await loaded.decoder.step(control, x, deadline)
                if span is not None:
                    span.set_attribute("mha.sequence.tokens_held", stepped.length)
        except DeviceLost as exc:  # the caches' device is gone: stop serving, as a lost batch does
            if self.device.observe(exc):
                self.set_state(State.FAILED)
            raise
        self.publish.answered(x.shape, stepped.timing, loaded.version, steps=True)
        return stepped.y, stepped.timing, stepped.length

    def check_ready(self) -> None:
        self.device.check()
        if self.state is State.DRAINING:
            raise NotReady("the server is draining for shutdown; retry on another replica")
        if self.state is State.LOADING:
            raise NotReady("the model is still loading; retry shortly")
        if self.state is not State.READY:
            raise NotReady(f"the model is not ready (state: {self.state.value}); retry shortly")

    def start_draining(self, announce: bool = True) -> None:
        if self.state is not State.DRAINING:
            level = logging.INFO if announce else logging.DEBUG
            log.log(level, "draining: new requests are refused, in-flight requests finish")
            self.set_state(State.DRAINING)
            self.draining.set()

    async def close(self) -> None:
        await self.loader.close()
        for loaded in list(self.versions):
            await loaded.decoder.close()
            await loaded.batcher.stop()
        self.audit.close()  # before the compute thread's: a mismatch quarantines its backend there
        self.executor.shutdown(wait=True)
        for loaded in list(self.versions):
            for backend in loaded.chain.backends:
                backend.close()


class VersionKeeper:
    """The versions' lives: loading them (at start, by poll, by load call), making them serve,
    retiring and unloading them, and what the metrics and readiness hear of it."""

    def __init__(self, core: InferenceCore, source: ModelSource) -> None:
        self.core = core
        self.loader = VersionLoader(source, core.versions, self.prepare, self.start, self.stop, self.changed)

    async def load_at_start(self) -> None:
        """Load the versions the source names (in explicit mode only with --load-model), off the
        event loop, then serve. A server of one model directory, or in mode none, that loads no
        version does not start."""
        s = self.core.settings
        if s.model_control_mode != "explicit" or s.load_model in ("*", s.model_name):
            try:
                report = await self.loader.sync()
            except Exception:
                self.core.set_state(State.FAILED)
                raise
            self.core.metrics.versions.counted(len(report.loaded), len(report.failed))
            if report.failed and not len(self.core.versions) and s.model_control_mode == "none":
                self.core.set_state(State.FAILED)
                raise ModelLoadError("; ".join(f"version {v}: {why}" for v, why in report.failed.items()))
        self.core.set_state(State.READY)

    async def sync(self, polled: bool = False) -> LoadReport:
        """Load what the repository names now, retire what it no longer names (poll, load calls)."""
        self.core.check_ready()
        report = await self.loader.sync(retry_refused=not polled)
        self.core.metrics.versions.counted(len(report.loaded), len(report.failed))
        return report

    async def load_call(self) -> None:
        """A load call (the repository API): what the repository names now, or why a version is
        refused (the versions serving go on)."""
        report = await self.sync()
        refusal = report.refusal(self.core.identity.name, [v.version for v in self.core.versions.serving()])
        if refusal is not None:
            raise refusal

    async def unload_call(self) -> None:
        """An unload call: every version stops taking requests, finishes what it queued, unloads."""
        self.core.check_ready()
        await self.loader.unload_all()

    def prepare(self, version: str, directory: Path | None) -> tuple[ServedModel, Selection, BackendChain]:
        """A version's model read, checked and self-checked, its backends chained (blocking)."""
        identity = replace(self.core.identity, version=version)
        return load_model(self.core.settings, identity, self.core.publish.fallback, directory)

    def start(self, prepared: tuple[ServedModel, Selection, BackendChain]) -> Loaded:
        """A version's batcher and live sequences, started (on the event loop)."""
        model, selection, chain = prepared
        core, s = self.core, self.core.settings
        batcher = Batcher(
            _batching(s, model),
            run_batch=partial(_run_batch, chain, hook=core.compute_hook),
            executor=core.executor,
            on_batch=partial(core.publish.batch, chain=chain, version=model.version),
            in_flight=lambda: core.requests.uncomputed,
            clock=core.clock,
            current_trace=core.tracing.current if core.tracing.enabled else None,
            schedule=core.schedule,
        )
        decoder = _decoder(s, model, chain, core.executor, core.clock, core)
        check = selection.check
        reference = Reference(check.config, check.weights, check.tolerance) if s.audit_rate > 0 else None
        loaded = Loaded(model, selection, chain, batcher, decoder, reference=reference)
        batcher.start()
        decoder.start(expiry_period_s=min(1.0, max(s.sequence_idle_timeout_s / 4, 0.05)))
        core.metrics.versions.loaded(model.labels())
        core.metrics.triton.loaded(core.publish.entries, model.version)
        for order in chain.orders():
            core.metrics.init_fallbacks([b.name for b in order], REASONS)
        for backend in chain.backends:  # 0 until an audit finds one of its answers wrong
            core.metrics.audit.mismatches.labels(backend.name, backend.device, model.precision)
        core.publish.backends(chain)
        return loaded

    def stop(self, loaded: Loaded) -> None:
        """A version's backends closed once it has stopped serving."""
        for backend in loaded.chain.backends:
            backend.close()
        self.core.metrics.versions.unloaded(loaded.model.labels())
        for entry in self.core.publish.entries:
            self.core.metrics.triton.pending.labels(entry, loaded.version).set(0)

    def changed(self) -> None:
        """The versions changed: their gauges, and readiness (explicit mode may unload them all)."""
        self.core.metrics.versions.changed([v.state.value for v in self.core.versions])
        self.core.device.serving_changed(self.core.serving_ok())

    def pending(self) -> None:
        """Triton's pending requests of each version: its stateless queue, its queued decode steps."""
        pending, (stateless, steps) = self.core.metrics.triton.pending, self.core.publish.entries
        for loaded in self.core.versions:
            pending.labels(stateless, loaded.version).set(loaded.batcher.depth)
            pending.labels(steps, loaded.version).set(loaded.decoder.steps.depth)

    def sequences_changed(self, version: str, evicted: str | None) -> None:
        """A version's live sequences changed: the gauges, and a retiring version may unload."""
        live = list(self.core.versions)
        self.core.metrics.sequences_changed(
            sum(v.live_sequences for v in live), sum(v.decoder.sequences.state_bytes for v in live), evicted
        )
        if (loaded := self.core.versions.get(version)) is not None:
            self.core.metrics.versions.held(version, loaded.live_sequences)
            self.loader.sequences_changed(loaded)


def single_source(s: Settings, read_policy: PolicyReader | None = None) -> ModelSource:
    """Where the settings say the versions are: a repository (its policy read by `read_policy`;
    none: Triton's default, the latest version), one model directory, or the default model's
    (which the app exports before the first load)."""
    if s.model_repository is not None:
        return ModelSource(s.model_name, repository=s.model_repository, read_policy=read_policy)
    return ModelSource(s.model_name, directory=s.model_dir or s.default_model_dir, version=s.model_version)


def _identity(s: Settings) -> ModelIdentity:
    return ModelIdentity(s.model_name, s.model_version, s.sequence_model_name or f"{s.model_name}_sequence")


def _run_batch(chain: BackendChain, x: np.ndarray, hook: ComputeHook | None = None) -> tuple[np.ndarray, str]:
    """(B, T, C) through the chain."""
    if hook is not None:
        hook("batch", [x])
    y, backend = chain.run(x)
    return y, backend.name


def _run_steps(
    chain: BackendChain, hook: ComputeHook | None, steps: Sequence[StepInput]
) -> tuple[list[np.ndarray], str]:
    """Decode steps through the chain's step backends, each step with its sequence's cache."""
    if hook is not None:
        hook("steps", [s.x for s in steps])
    ys, backend = chain.run_steps(steps)
    return ys, backend.name


def load_model(
    settings: Settings, identity: ModelIdentity, on_fallback: FallbackHook, directory: Path | None = None
) -> tuple[ServedModel, Selection, BackendChain]:
    """Read the model directory, load and self-check the backends (decode steps included), and
    chain them (blocking). The default model is exported by the app before it loads."""
    s = settings
    if directory is None:
        raise ModelLoadError("no model directory to serve: give --model-dir, or --default-model-dir")
    files = ModelFiles(directory)
    try:
        config, weights = load_checkpoint(files.weights)
    except CheckpointError as exc:
        raise ModelLoadError(f"cannot serve {files.directory}: {exc}") from exc
    weights_sha256 = sha256_file(files.weights)  # once: the manifest check and the published identity
    verified = _verified(files, config, weights_sha256, s.allow_unverified)
    onnx_path = files.directory / precision_file(s.precision)
    if not onnx_path.is_file():
        raise ModelLoadError(
            f"{files.directory} has no {s.precision} graph ({onnx_path.name}); re-export it with "
            f"`mha export --precision fp32,{s.precision}`, or serve --precision fp32"
        )
    spec = BackendSpec(
        onnx_path,
        config,
        weights,
        step_path=files.step if config.causal and files.step.is_file() else None,
        threads=s.cpu_threads,
        spinning=s.thread_spinning,
        gpu_mem_limit_mb=s.gpu_mem_limit_mb,
        precision=s.precision,
    )
    selection = select_backends(spec, requested=s.backend)
    if not selection.backends:
        raise ModelLoadError(f"no backend can serve {files.directory}: {selection.summary()}")
    chain = BackendChain(
        selection.backends,
        probe=selection.check.passes,
        failure_threshold=s.fallback_failures,
        cooldown_s=s.fallback_cooldown_s,
        on_fallback=on_fallback,
        light=selection.light,
        step_backends=selection.step_backends,
    )
    active = chain.active
    log.info("serving %s with %s on %s", files.directory, active.name, active.device)  # the verdict: selection's
    bound = magnitude_bound(config, weights, s.precision)  # below it no backend can overflow
    served = ServedModel(
        identity, config, files, s.max_request_rows, s.max_attention_mb, weights_sha256, verified, bound, s.precision
    )
    _log_steps(chain, config, s, files)
    return served, selection, chain


def _log_steps(chain: BackendChain, config: MHAConfig, s: Settings, files: ModelFiles) -> None:
    """Say which backend computes decode steps, or why none does."""
    if (steps := chain.step_backends) and steps[0].device == "cpu" and s.require_device == "cuda":
        log.warning("decode steps run on the CPU: no backend reaches the caches on a CUDA device (see docs/api.md)")
    elif steps:
        log.info("decode steps run on %s (%s)", steps[0].name, steps[0].device)
    elif config.causal:
        log.warning("no backend computes decode steps: %s has no step.onnx (re-export it)", files.directory)


def _follow(metrics: Metrics, core: InferenceCore) -> None:
    """The gauges read from the core at each scrape."""
    metrics.queue_capacity.set(core.settings.max_queue_size)
    metrics.follow(metrics.inflight, lambda: core.requests.count)
    metrics.follow(metrics.inflight_bytes, lambda: core.budget.held)
    metrics.follow(metrics.queue_depth, lambda: sum(v.batcher.depth for v in core.versions))
    metrics.inflight_budget.set(core.budget.limit)
    metrics.follow(metrics.ready, lambda: 1 if core.serving_ok() else 0)  # the one readiness, as every signal
    metrics.on_refresh(core.keeper.pending)


def _audit_limits(s: Settings) -> AuditLimits:
    limits = (s.audit_rate, s.audit_max_cpu, s.audit_queue, s.audit_max_tokens, s.audit_when_busy)
    return AuditLimits(*limits, busy_depth=_merged_rows(s))


def _audited(core: InferenceCore, sample: Sample, reference: Reference, error: float, spent_s: float) -> None:
    """An audit's verdict (on the audit thread): counted; a mismatch logged, counted by backend,
    device and precision, and its backend quarantined on the compute thread (where the chain runs)."""
    core.metrics.audit.checked_one(spent_s)
    if math.isfinite(error) and error <= reference.tolerance:
        return
    core.metrics.audit.mismatch(sample.backend, sample.device, sample.precision)
    log.error(mismatch_message(sample, reference, error))
    core.executor.submit(sample.quarantine, sample.backend)


def _serving(loaded: Loaded, s: Settings, schedule: SchedulePolicy) -> Serving:
    chain, summary = loaded.chain, loaded.selection.summary()
    limits = (_merged_rows(s), s.max_queue_delay_ms, s.max_sequences, s.sequence_idle_timeout_s)
    return Serving(chain.backends, chain.active, summary, *limits, schedule)


def _merged_rows(s: Settings) -> int:
    """Rows the batcher merges requests into: --max-batch-size, never past --max-request-rows (the
    config's max_batch_size, which in Triton bounds every batch executed)."""
    return min(s.max_batch_size, s.max_request_rows)


def _batching(s: Settings, model: ServedModel) -> BatcherConfig:
    return BatcherConfig(
        max_batch_size=_merged_rows(s),
        max_queue_delay_s=s.max_queue_delay_ms / 1e3,
        max_queue_size=s.max_queue_size,
        max_padding_ratio=s.max_padding_ratio,
        causal=model.config.causal,
        max_cells=model.max_attention_cells,
    )


def _decoder(
    s: Settings,
    model: ServedModel,
    chain: BackendChain,
    executor: ThreadPoolExecutor,
    clock: Clock,
    core: InferenceCore,
) -> Decoder:
    """A version's live sequences within the settings' limits, and the batcher of their steps."""
    limits = SequenceLimits(s.max_sequences, s.sequence_idle_timeout_s, int(s.max_sequence_state_mb * 2**20))
    core.metrics.sequence_limits(limits.max_sequences, limits.max_state_bytes)
    version = model.version

    def changed(store: SequenceStore, evicted: str | None) -> None:
        core.keeper.sequences_changed(version, evicted)

    device = chain.steps_device or "cpu"  # where the sequences' caches live
    steps = StepBatcher(
        partial(_run_steps, chain, core.compute_hook),
        executor,
        s.max_step_rows,
        max_queue_size=s.max_queue_size,
        in_flight=lambda: core.requests.uncomputed,
        on_batch=partial(core.publish.batch, chain=chain, version=model.version, steps=True),
        clock=clock,
    )
    where = f"replica {s.replica!r} worker {s.worker_index} (version {version})"  # in every NOT_FOUND and refusal
    store = SequenceStore(model.config, limits, clock.now, changed, device, where)
    return Decoder(store, steps, require_offset=s.require_sequence_offset)


def _verified(files: ModelFiles, config: MHAConfig, weights_sha256: str, allow_unverified: bool) -> bool:
    """Does manifest.json vouch for what is about to be served? Refuse unless allowed."""
    problems = check_manifest(files, config, weights_sha256)
    if problems and not allow_unverified:
        raise ModelLoadError(
            f"refusing to serve {files.directory}: {'; '.join(problems)}. Re-export it with `mha export`, "
            "or pass --allow-unverified to serve it anyway"
        )
    if problems:
        log.error("serving %s UNVERIFIED (--allow-unverified): %s", files.directory, "; ".join(problems))
    return not problems


INFLIGHT_SHARE = 4  # by default, a quarter of the memory limit goes to requests and answers in flight


def _inflight_limit(settings: Settings) -> int:
    """--max-inflight-mb, or a quarter of the memory limit, shared by the workers."""
    if settings.max_inflight_mb:
        return max(1, int(settings.max_inflight_mb * MIB))
    return max(MIB, memory_limit_bytes() // INFLIGHT_SHARE // settings.worker_peers)
