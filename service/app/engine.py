"""The engine as the app builds it from the settings: the versions and their keeper, what they
report to (metrics, statistics, the audit), the door the wire calls, and the gauges read at each
scrape. The one place these parts meet."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from service.app.model_config import read_policy
from service.batching import Clock, MonotonicClock
from service.budget import MIB, InflightBudget
from service.decode.sequences import SequenceStore
from service.engine.audit import Audit, AuditLimits, Auditor, Check, Gate, Sample, distrusted, mismatch_message
from service.engine.door import Door, SequenceId, Verdict
from service.engine.inflight import InFlight
from service.engine.keeper import Compute, ComputeHook, ModelLoadError, VersionKeeper, merged_rows, single_source
from service.engine.publishing import Publisher, ServingBackends
from service.engine.readiness import DeviceHealth, Lifecycle
from service.engine.served import ModelIdentity
from service.engine.sources import ModelSource
from service.engine.versions import Loaded, Versions
from service.errors import quote
from service.metrics import Metrics
from service.resources import memory_limit_bytes
from service.scheduling import SchedulePolicy
from service.settings import Settings
from service.tracing import Tracing

log = logging.getLogger(__name__)
INFLIGHT_SHARE = 4  # by default, a quarter of the memory limit goes to requests and answers in flight
CPU = "cpu"  # what every worker computes on alike; a GPU too, unless each has its own (--workers auto)
Tell = Callable[[str, str, str, int], None]  # (version, backend, device, times): told to the other workers


@dataclass(frozen=True)
class Engine:
    """What the app holds of the engine: to load, drain and close it, and to hand the wire its door."""

    settings: Settings
    metrics: Metrics
    life: Lifecycle
    keeper: VersionKeeper
    publish: Publisher
    audit: Audit
    door: Door
    budget: InflightBudget  # bytes of requests and answers held at once

    @property
    def loaded(self) -> Loaded:
        """The latest version serving."""
        return self.life.loaded

    @property
    def requests(self) -> InFlight:
        return self.keeper.compute.requests

    @property
    def tracing(self) -> Tracing:
        return self.keeper.compute.tracing

    async def close(self) -> None:
        """Every version's loads, sequences and batchers stopped (what they queued finished), the
        audit, the compute thread, then the backends."""
        await self.keeper.loader.close()
        for loaded in list(self.life.versions):
            await loaded.decoder.close()
            await loaded.batcher.stop()
        self.audit.close()  # before the compute thread's: a mismatch quarantines its backend there
        self.keeper.compute.executor.shutdown(wait=True)
        for loaded in list(self.life.versions):
            for backend in loaded.chain.backends:
                backend.close()


def build_engine(
    settings: Settings,
    metrics: Metrics,
    source: ModelSource,
    schedule: SchedulePolicy,
    clock: Clock | None = None,
    tracing: Tracing | None = None,
    hook: ComputeHook | None = None,
    others_ready: Callable[[], bool] | None = None,
    sequence_gone: Callable[[SequenceId], None] | None = None,
    tell: Tell | None = None,
) -> Engine:
    """`clock` is the batchers' (request deadlines are converted to it); `hook` see ComputeHook;
    `others_ready` the door's (with --workers: whether every other worker listens);
    `sequence_gone` the keeper's (with --workers: a sequence's ownership released);
    `tell` the audit's (with --workers: a backend found wrong on the CPU told to the others)."""
    s = settings
    identity = ModelIdentity(s.model_name, s.model_version, s.sequence_model_name or f"{s.model_name}_sequence")
    device = DeviceHealth(s.require_device, metrics)  # the server's health follows serving_ok()
    life = Lifecycle(identity, Versions(s.model_name), device)
    tracing = tracing or Tracing()
    serving = ServingBackends(metrics, device, life.serving_ok, life.fail)
    publish = Publisher(metrics, serving, tracing, (identity.name, identity.sequence_name))
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer")  # every version's batches
    compute = Compute(executor, clock or MonotonicClock(), InFlight(), schedule, tracing, hook)
    keeper = VersionKeeper(s, life, compute, publish, metrics, source, sequence_gone)
    verdicts = Verdicts(metrics, life.versions, executor, asyncio.get_running_loop(), tell, s.worker_own_gpu)
    audit: Audit = (
        Gate(verdicts.checked, s.audit_max_tokens)
        if s.audit_before_answer
        else Auditor(_audit_limits(s), verdicts.checked, metrics.audit.skipped_one)
    )
    budget = InflightBudget(_inflight_limit(s))  # bytes of requests and answers held at once
    door = Door(life, keeper, publish, audit, budget, verdicts.told, others_ready)
    _follow(metrics, s, life, keeper, budget)
    return Engine(s, metrics, life, keeper, publish, audit, door, budget)


def _follow(metrics: Metrics, s: Settings, life: Lifecycle, keeper: VersionKeeper, budget: InflightBudget) -> None:
    """The gauges read from the engine at each scrape."""
    requests = keeper.compute.requests
    metrics.serving.load.queue_capacity.set(s.max_queue_size)
    metrics.follow(metrics.serving.load.inflight, lambda: requests.count)
    metrics.follow(metrics.serving.load.inflight_bytes, lambda: budget.held)
    metrics.follow(metrics.serving.load.queue_depth, lambda: sum(v.batcher.depth for v in life.versions))
    metrics.serving.load.inflight_budget.set(budget.limit)
    metrics.follow(metrics.serving.ready, lambda: 1 if life.serving_ok() else 0)  # the one readiness, as every signal
    metrics.on_refresh(partial(_pending, metrics, life.versions, keeper.publish.entries))


def _pending(metrics: Metrics, versions: Versions, entries: tuple[str, str]) -> None:
    """Triton's pending requests of each version: its stateless queue, its queued decode steps."""
    pending, (stateless, steps) = metrics.triton.pending, entries
    for loaded in versions:
        pending.labels(stateless, loaded.version).set(loaded.batcher.depth)
        pending.labels(steps, loaded.version).set(loaded.decoder.steps.depth)


def _audit_limits(s: Settings) -> AuditLimits:
    limits = (s.audit_rate, s.audit_max_cpu, s.audit_queue, s.audit_max_tokens, s.audit_when_busy)
    return AuditLimits(*limits, busy_depth=merged_rows(s))


class Verdicts:
    """What follows an audit's verdict (`checked`, on the audit thread): counted; a mismatch logged,
    counted by backend, device and precision, and its backend distrusted. Distrusted: quarantined on
    the compute thread (where the chain runs), then, on the event loop, every live sequence whose
    steps it computed dropped (a step computed on it before the quarantine has recorded it by then:
    the compute thread runs one thing at a time). A backend computing on a device every worker
    shares (the CPU; the GPUs, unless each worker has its own) is distrusted by the other workers
    too: `tell` tells them, `told` is their side."""

    def __init__(
        self,
        metrics: Metrics,
        versions: Versions,
        executor: ThreadPoolExecutor,
        loop: asyncio.AbstractEventLoop,
        tell: Tell | None,
        own_gpu: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`own_gpu`: each worker computes on a GPU of its own, so that a GPU's verdict is its alone."""
        self._metrics, self._versions, self._executor, self._loop, self._tell = metrics, versions, executor, loop, tell
        self._own_gpu, self._clock = own_gpu, clock
        self._passed: dict[tuple[str, str], tuple[float, str]] = {}  # (version, backend): its last pass, when, whose

    def checked(self, sample: Sample, check: Check, spent_s: float) -> None:
        self._metrics.audit.checked_one(spent_s)
        if check.passed:
            self._passed[sample.version, sample.backend] = (self._clock(), sample.request_id)
            return
        self._metrics.audit.mismatch(sample.backend, sample.device, sample.precision)
        log.error("%s; %s", mismatch_message(sample, check), self._since(sample))
        tell = self._tell if sample.device == CPU or not self._own_gpu else None
        then = None if tell is None else partial(tell, sample.version, sample.backend, sample.device)
        self._distrust(sample.quarantine, sample.sequences, sample.backend, then)  # then(times): a new incident

    def _since(self, sample: Sample) -> str:
        """Since when its answers may be wrong: after the last audit of it that passed (none,
        where every answer waits for its check)."""
        backend = sample.backend
        if sample.held:
            return "the answer waited for this check and was not sent: its request is refused"
        if (last := self._passed.get((sample.version, backend))) is None:
            return f"no audit of {backend} passed before in this worker: any answer of it may be wrong"
        when, request_id = last
        return (
            f"answers of {backend} since its last audit that passed, {self._clock() - when:.1f} s before (request "
            f"{quote(request_id)}), may be wrong too"
        )

    def told(self, verdict: Verdict) -> None:
        """Another worker's audit found a backend computing wrongly (on the event loop): this
        worker's backend of that name on that device counts it, and sits out what is left of the
        cool-down, as if its own audit had found it. A version or backend not served here, or not
        on that device, is left as it is."""
        loaded = self._versions.get(verdict.version)
        chain = [] if loaded is None else loaded.chain.backends + loaded.chain.step_backends
        if loaded is None or not any(b.name == verdict.backend and b.device == verdict.device for b in chain):
            return
        log.warning(
            "audit: %s found %s of version %s computing wrongly, %.0f s ago (%s); this worker takes the verdict as "
            "its own",
            verdict.by,
            verdict.backend,
            quote(loaded.version),
            verdict.ago_s,
            "once" if verdict.times == 1 else f"{verdict.times} times so far",
        )
        join = partial(loaded.chain.quarantine.join, times=verdict.times, ago_s=verdict.ago_s)
        self._distrust(join, loaded.decoder.sequences, verdict.backend, None)

    def _distrust(
        self,
        quarantine: Callable[[str], int],
        sequences: SequenceStore | None,
        backend: str,
        then: Callable[[int], None] | None,
    ) -> None:
        quarantined = self._executor.submit(quarantine, backend)
        quarantined.add_done_callback(
            lambda done: self._loop.call_soon_threadsafe(self._drop, sequences, backend, then, done.result())
        )

    @staticmethod
    def _drop(sequences: SequenceStore | None, backend: str, then: Callable[[int], None] | None, times: int) -> None:
        if sequences is not None and (dropped := sequences.drop(distrusted(backend), written_by=backend)):
            log.warning("audit: %d live sequences dropped: %s computed steps of them", dropped, backend)
        if then is not None and times:  # a new incident (0: one the others were told of already)
            then(times)


def _inflight_limit(settings: Settings) -> int:
    """This worker's share of --max-inflight-mb (0: a quarter of the memory limit): the bound is
    the server's, whatever the number of its workers."""
    whole = settings.max_inflight_mb * MIB if settings.max_inflight_mb else memory_limit_bytes() / INFLIGHT_SHARE
    return max(1, int(whole) // settings.worker_peers)


def serves_default_model(settings: Settings) -> bool:
    """No --model-dir and no repository: the default model, in --default-model-dir."""
    return settings.model_repository is None and settings.model_dir is None


def export_default_model(settings: Settings) -> Path:
    """The default model's directory, exported there first if it holds no complete export
    (blocking: about 15 s on 2 CPUs). The app does this before the first load; the engine only
    loads what exists."""
    from export.pipeline import ensure_default_model

    if settings.default_model_dir is None:
        raise ModelLoadError("no model directory to serve: give --model-dir, or --default-model-dir")
    try:
        return ensure_default_model(settings.default_model_dir)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot export the default model into {settings.default_model_dir}: {exc.strerror or exc}; "
            "give --default-model-dir (or MHA_DEFAULT_MODEL_DIR) a writable directory"
        ) from exc


async def load(engine: Engine, settings: Settings) -> None:
    """The model's versions loaded, the default model exported first (off the event loop) when
    it is the one served."""
    if serves_default_model(settings):
        await asyncio.to_thread(export_default_model, settings)
    await engine.keeper.load_at_start()


def model_source(settings: Settings) -> ModelSource:
    """Where the settings say the model's versions are, each model's policy read from its config.pbtxt."""
    return single_source(settings, read_policy)


async def poll(keeper: VersionKeeper, stop: asyncio.Event) -> None:
    """--model-control-mode poll: read the repository again every --repository-poll-secs, until
    `stop` is set. A refused version is said once, and tried again once its files change."""
    period, clock = keeper.settings.repository_poll_secs, keeper.compute.clock
    while not stop.is_set():
        await clock.wait(stop, clock.now() + period)
        if stop.is_set():
            return
        try:
            await keeper.sync(polled=True)
        except Exception as exc:  # draining, or a fault: the next poll tries again
            log.warning("polling the repository failed: %s", exc)
