"""The versions' lives: a model directory read, checked and self-checked into a version with its
backends chained, its batcher and live sequences started on the shared compute thread, retired
and unloaded, and what the metrics and readiness hear of it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np

from export.layout import ModelFiles, precision_file
from export.verify import check_manifest, sha256_file
from model import MHAConfig
from model.checkpoint import CheckpointError, load_checkpoint
from service.backends.chain import REASONS, BackendChain, FallbackHook
from service.backends.selection import BackendSpec, Selection, Timings, select_backends
from service.batching import BatcherConfig, Clock
from service.decode.control import SequenceId
from service.decode.scheduler import Decoder, StepBatcher
from service.decode.sequences import SequenceLimits, SequenceStore
from service.engine.audit import Reference
from service.engine.door import Batcher
from service.engine.inflight import InFlight
from service.engine.loading import LoadReport, VersionLoader
from service.engine.publishing import Publisher
from service.engine.readiness import Lifecycle, State
from service.engine.served import ModelIdentity, ServedModel, Serving
from service.engine.sources import ModelSource, PolicyReader, VersionPolicy
from service.engine.versions import Loaded
from service.errors import FeatureOff, ModelNotFound, quote
from service.metrics import Metrics
from service.numerics import magnitude_bound
from service.scheduling import SchedulePolicy
from service.settings import Settings
from service.tracing import Tracing

log = logging.getLogger(__name__)
Prepared = tuple[ServedModel, Selection, BackendChain]
In = TypeVar("In")  # what a compute takes: a batch (B, T, C), or decode steps
Out = TypeVar("Out")  # what it returns, with the backend that computed it

# Called on the computing thread before every batch (kind "batch", its merged input) and every batch
# of decode steps ("steps", each step's new tokens): it may block, or raise as a failing compute
# would. None in production.
ComputeHook = Callable[[str, Sequence[np.ndarray]], None]


MODEL_CONTROL_OFF = (
    "model control is off: this server serves the versions it found at start (--model-control-mode none); "
    "start it with --model-control-mode explicit to load and unload on request, or poll to follow the repository"
)
MODEL_CONTROL_POLLED = (
    "this server follows its repository (--model-control-mode poll): change the repository and the next poll "
    "loads it; load and unload calls are for --model-control-mode explicit"
)


class ModelLoadError(RuntimeError):
    """The model directory cannot be served; the message says why."""


@dataclass(frozen=True)
class Compute:
    """What every version's batchers share: the one compute thread, the clock request deadlines
    are on, the requests in flight (the batchers wait only for these), the schedule policy,
    tracing, and the hook tests hold computes and inject failures with."""

    executor: ThreadPoolExecutor
    clock: Clock
    requests: InFlight
    schedule: SchedulePolicy
    tracing: Tracing
    hook: ComputeHook | None = None


class VersionKeeper:
    def __init__(
        self,
        settings: Settings,
        life: Lifecycle,
        compute: Compute,
        publish: Publisher,
        metrics: Metrics,
        source: ModelSource,
        sequence_gone: Callable[[SequenceId], None] | None = None,
    ) -> None:
        self.settings, self.life, self.compute, self.publish, self.metrics = settings, life, compute, publish, metrics
        self.loader = VersionLoader(source, life.versions, self)
        self._sequence_gone = sequence_gone  # told of a sequence no version keeps any more (--workers: owned no more)

    @property
    def policy(self) -> VersionPolicy:
        return self.loader.policy

    async def load_at_start(self) -> None:
        """Load the versions the source names (in explicit mode only with --load-model), off the
        event loop, then serve. A server of one model directory, or in mode none, that loads no
        version does not start."""
        s = self.settings
        if s.model_control_mode != "explicit" or s.load_model in ("*", s.model_name):
            try:
                report = await self.loader.sync()
            except Exception:
                self.life.fail()
                raise
            if report.failed and not len(self.life.versions) and s.model_control_mode == "none":
                self.life.fail()  # the start fails: its one line says why
                raise ModelLoadError("; ".join(f"version {v}: {why}" for v, why in report.failed.items()))
            report.tell(self.life.identity.name, self.metrics.versions.counted)
        self.life.set_state(State.READY)

    async def sync(self, polled: bool = False) -> LoadReport:
        """Load what the repository names now, retire what it no longer names (poll, load calls)."""
        self.life.check_ready()
        report = await self.loader.sync(retry_refused=not polled)
        report.tell(self.life.identity.name, self.metrics.versions.counted)
        return report

    async def load_call(self, name: str) -> None:
        """A load call (the repository API): what the repository names now, or why a version is
        refused (the versions serving go on)."""
        self._controlled(name)
        report = await self.sync()
        refusal = report.refusal(self.life.identity.name, [v.version for v in self.life.versions.serving()])
        if refusal is not None:
            raise refusal

    async def unload_call(self, name: str) -> None:
        """An unload call: every version stops taking requests, finishes what it queued, unloads."""
        self._controlled(name)
        self.life.check_ready()
        await self.loader.unload_all()

    def _controlled(self, name: str) -> None:
        """Load and unload calls: only in explicit mode, and only for this server's model."""
        mode = self.settings.model_control_mode
        if mode == "none":
            raise FeatureOff(MODEL_CONTROL_OFF)
        if mode == "poll":
            raise FeatureOff(MODEL_CONTROL_POLLED)
        if name not in self.life.identity.names:
            raise ModelNotFound(f"unknown model {quote(name)}; this server serves {self.life.identity.name!r}")

    def prepare(self, version: str, directory: Path | None) -> Prepared:
        """A version's model read, checked and self-checked, its backends chained (blocking)."""
        identity = replace(self.life.identity, version=version)
        return load_model(self.settings, identity, self.publish.fallback, directory)

    def start(self, prepared: Prepared) -> Loaded:
        """A version's batcher and live sequences, started (on the event loop)."""
        model, selection, chain = prepared
        s, compute = self.settings, self.compute
        batcher = Batcher(
            _batching(s, model),
            run_batch=_hooked(chain.run, "batch", compute.hook, lambda x: [x]),
            executor=compute.executor,
            on_batch=partial(self.publish.batch, chain=chain, version=model.version),
            in_flight=lambda: compute.requests.uncomputed,
            clock=compute.clock,
            current_trace=compute.tracing.current if compute.tracing.enabled else None,
            schedule=compute.schedule,
        )
        steps = StepBatcher(
            _hooked(chain.run_steps, "steps", compute.hook, lambda steps: [step.x for step in steps]),
            compute.executor,
            s.max_step_rows,
            max_queue_size=s.max_queue_size,
            in_flight=lambda: compute.requests.uncomputed,
            on_batch=partial(self.publish.batch, chain=chain, version=model.version, steps=True),
            clock=compute.clock,
        )
        decoder = Decoder(self._sequences(model, chain), steps, require_offset=s.require_sequence_offset)
        check = selection.check
        audit = s.audit_rate > 0 or s.audit_before_answer
        reference = Reference(check.config, check.weights, check.tolerance, model.precision) if audit else None
        loaded = Loaded(model, selection, chain, batcher, decoder, reference=reference)
        batcher.start()
        decoder.start(expiry_period_s=min(1.0, max(s.sequence_idle_timeout_s / 4, 0.05)))
        _announce(self.metrics, self.publish, model, chain)
        return loaded

    def _sequences(self, model: ServedModel, chain: BackendChain) -> SequenceStore:
        """A version's live sequences within the settings' limits, their caches where its steps run."""
        s, version = self.settings, model.version
        limits = SequenceLimits(s.max_sequences, s.sequence_idle_timeout_s, int(s.max_sequence_state_mb * 2**20))
        self.metrics.sequences.limits(limits.max_sequences, limits.max_state_bytes)
        where = f"replica {s.replica!r} worker {s.worker_index} (version {version})"  # in every NOT_FOUND and refusal
        device = chain.steps_device or "cpu"
        changed = partial(self.sequences_changed, version)
        return SequenceStore(model.config, limits, self.compute.clock.now, changed, device, where)

    def stop(self, loaded: Loaded) -> None:
        """A version's backends closed once it has stopped serving."""
        for backend in loaded.chain.backends:
            backend.close()
        self.metrics.versions.unloaded(loaded.model.labels())
        for entry in self.publish.entries:
            self.metrics.triton.pending.labels(entry, loaded.version).set(0)

    def changed(self) -> None:
        """The versions changed: their gauges, and readiness (explicit mode may unload them all)."""
        self.metrics.versions.changed([v.state.value for v in self.life.versions])
        self.life.device.serving_changed(self.life.serving_ok())

    def sequences_changed(
        self, version: str, store: SequenceStore, evicted: str | None, gone: SequenceId | None
    ) -> None:
        """A version's live sequences changed: the gauges, a sequence no version keeps any more
        reported gone, and a retiring version may unload."""
        if gone is not None and self._sequence_gone is not None and not self.life.versions.holds(gone):
            self._sequence_gone(gone)
        live = list(self.life.versions)
        self.metrics.sequences.changed(
            sum(v.live_sequences for v in live), sum(v.decoder.sequences.state_bytes for v in live), evicted
        )
        if (loaded := self.life.versions.get(version)) is not None:
            self.metrics.versions.held(version, loaded.live_sequences)
            self.loader.sequences_changed(loaded)

    def serving(self, loaded: Loaded) -> Serving:
        """What metadata and config calls describe of how `loaded` serves."""
        s, chain = self.settings, loaded.chain
        limits = (merged_rows(s), s.max_queue_delay_ms, s.max_sequences, s.sequence_idle_timeout_s)
        return Serving(chain.backends, chain.active, loaded.selection.summary(), *limits, self.compute.schedule)


def single_source(s: Settings, read_policy: PolicyReader | None = None) -> ModelSource:
    """Where the settings say the versions are: a repository (its policy read by `read_policy`;
    none: Triton's default, the latest version), one model directory, or the default model's
    (which the app exports before the first load)."""
    if s.model_repository is not None:
        return ModelSource(s.model_name, repository=s.model_repository, read_policy=read_policy)
    return ModelSource(s.model_name, directory=s.model_dir or s.default_model_dir, version=s.model_version)


def _hooked(
    run: Callable[[In], Out], kind: str, hook: ComputeHook | None, tensors: Callable[[In], list[np.ndarray]]
) -> Callable[[In], Out]:
    """`run` itself in production; with a test's hook, the hook first (on `tensors` of the input)."""
    if hook is None:
        return run

    def hooked(inputs: In) -> Out:
        hook(kind, tensors(inputs))
        return run(inputs)

    return hooked


def _announce(metrics: Metrics, publish: Publisher, model: ServedModel, chain: BackendChain) -> None:
    """A version starting to serve, in the metrics: its labels, its series at 0, its backends."""
    metrics.versions.loaded(model.labels())
    metrics.triton.loaded(publish.entries, model.version)
    for order in chain.orders():
        metrics.requests.init_fallbacks([b.name for b in order], REASONS)
    for backend in chain.backends:  # 0 until an audit finds one of its answers wrong
        metrics.audit.mismatches.labels(backend.name, backend.device, model.precision)
    publish.serving.show(chain)


def load_model(
    settings: Settings, identity: ModelIdentity, on_fallback: FallbackHook, directory: Path | None = None
) -> Prepared:
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
        step_paths=files.steps if config.causal and all(p.is_file() for p in files.steps) else None,
        threads=s.cpu_threads,
        spinning=s.thread_spinning,
        gpu_mem_limit_mb=s.gpu_mem_limit_mb,
        precision=s.precision,
    )
    kept = _timings_file(s, onnx_path, weights_sha256)
    known = _known_timings(kept)
    selection = select_backends(spec, requested=s.backend, known=known)
    if known is None:
        _keep_timings(kept, selection.timings)
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
    log.info("serving %s with %s on %s", files.directory, chain.describe(), active.device)  # selection's verdict
    bound = magnitude_bound(config, weights, s.precision)  # below it no backend can overflow
    served = ServedModel(
        identity, config, files, s.max_request_rows, s.max_attention_mb, weights_sha256, verified, bound, s.precision
    )
    _log_steps(chain, config, s, files)
    return served, selection, chain


def _timings_file(s: Settings, onnx_path: Path, weights_sha256: str) -> Path | None:
    """Where a replica's workers keep the timings of this model's backends, so that one worker
    measures and the others, started after it or restarted, make its choices (None: no workers).
    The folder is the workers' own (0700), new with each start of the replica. A worker with a
    GPU of its own (which may be another kind of GPU, or MIG slice) keeps its timings to itself."""
    if s.worker_socket_dir is None:
        return None
    measured = [str(onnx_path.resolve()), weights_sha256, s.backend, s.cpu_threads, s.thread_spinning, s.precision]
    measured.append(s.worker_index if s.worker_own_gpu else None)
    key = hashlib.sha256(json.dumps(measured).encode()).hexdigest()[:16]
    return s.worker_socket_dir / f"timings-{key}.json"


def _known_timings(path: Path | None) -> Timings | None:
    """The timings another worker kept at `path`, if it has."""
    if path is None:
        return None
    try:
        known = Timings.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("measuring the backends again: %s cannot be read (%s)", path, exc)
        return None
    log.info("backends timed by another worker of this replica (%s): its choices, not measured again", path.name)
    return known


def _keep_timings(path: Path | None, timings: Timings) -> None:
    """Keep what this worker measured for the others (written whole, then renamed into place)."""
    if path is None:
        return
    partial_file = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        partial_file.write_text(timings.to_json())
        os.replace(partial_file, path)
    except OSError as exc:
        log.warning("the other workers will time the backends themselves: %s cannot be written (%s)", path, exc)


def _log_steps(chain: BackendChain, config: MHAConfig, s: Settings, files: ModelFiles) -> None:
    """Say which backend computes decode steps, or why none does."""
    if (steps := chain.step_backends) and steps[0].device == "cpu" and s.require_device == "cuda":
        log.warning("decode steps run on the CPU: no backend reaches the caches on a CUDA device (see docs/api.md)")
    elif steps:
        log.info("decode steps run on %s (%s)", steps[0].name, steps[0].device)
    elif config.causal:
        log.warning("no backend computes decode steps: %s has no step graphs (re-export it)", files.directory)


def merged_rows(s: Settings) -> int:
    """Rows the batcher merges requests into: --max-batch-size, never past --max-request-rows (the
    config's max_batch_size, which in Triton bounds every batch executed)."""
    return min(s.max_batch_size, s.max_request_rows)


def _batching(s: Settings, model: ServedModel) -> BatcherConfig:
    return BatcherConfig(
        max_batch_size=merged_rows(s),
        max_queue_delay_s=s.max_queue_delay_ms / 1e3,
        max_queue_size=s.max_queue_size,
        max_padding_ratio=s.max_padding_ratio,
        causal=model.config.causal,
        max_cells=model.max_attention_cells,
    )


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
