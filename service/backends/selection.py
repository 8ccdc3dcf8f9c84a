"""Which backends serve, in which order, and why: load, self-check, measure."""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from export.layout import precision_tolerance
from model import MHAConfig
from model.checkpoint import Weights
from model.reference import attention_view, relative_error
from service.backends.base import Backend, BackendLoadError, Step
from service.backends.chain import LightRoute
from service.batching import batch_mflop
from service.settings import BACKEND_CHOICES

log = logging.getLogger(__name__)

SELF_CHECK_TOLERANCE = 1e-5  # relative, against the float64 reference
V = TypeVar("V")  # a measured value: a backend's probe medians, or its step time


@dataclass(frozen=True)
class BackendSpec:
    """What the backends are built from: the exported graphs, the weights, and how to run them."""

    onnx_path: Path
    config: MHAConfig
    weights: Weights
    step_paths: tuple[Path, Path] | None = None  # the step graphs, for ORT's decode steps
    threads: int = 1
    spinning: bool = False
    gpu_mem_limit_mb: int = 0
    precision: str = "fp32"


@dataclass
class CandidateReport:
    name: str
    status: str  # "serving", "fallback", "unavailable", "failed-self-check"
    reason: str
    probe_ms: float | None = None  # geometric mean of the probe medians, where measured


@dataclass
class Timings:
    """What a start measured of its backends, by backend name: the probe medians (ms, one per
    probe shape), the decode step's time (ms), and the tokens (rows x T) up to which a batch runs
    on one thread. A replica's other workers reuse them (engine/keeper.py): the same choices as
    the worker that measured, without measuring again."""

    probes: dict[str, list[float]] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    one_thread: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Timings:
        """The timings `to_json` wrote; ValueError for anything else."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {"probes", "steps", "one_thread"}:
            raise ValueError("not the timings of a start")
        probes, steps, one_thread = data["probes"], data["steps"], data["one_thread"]
        if not all(isinstance(d, dict) for d in (probes, steps, one_thread)):
            raise ValueError("not the timings of a start")
        if not all(isinstance(each, list) for each in probes.values()):
            raise ValueError("a backend's probe times that are not a list")
        times = [ms for each in probes.values() for ms in each] + list(steps.values())
        if not all(isinstance(ms, float) and 0 < ms < math.inf for ms in times):
            raise ValueError("a time that is not a positive number of milliseconds")
        if not all(isinstance(n, int) and n >= 0 for n in one_thread.values()):
            raise ValueError("a token count that is not a whole number")
        return cls(probes, steps, one_thread)


@dataclass
class Selection:
    backends: list[Backend]  # serving order: the first serves, the rest are the fallback chain
    check: SelfCheck  # what each backend passed; the chain probes quarantined backends with it
    candidates: list[CandidateReport] = field(default_factory=list)
    light: LightRoute | None = None  # where light batches go when another backend wins them
    step_backends: list[Backend] = field(default_factory=list)  # decode steps' serving order, one device
    timings: Timings = field(default_factory=Timings)  # what the choices were made on

    def summary(self) -> str:
        return "; ".join(f"{c.name}: {c.status} ({c.reason})" for c in self.candidates)


@dataclass
class ProbeCache:
    """A KVCache of its own for probing a backend's decode steps."""

    keys: torch.Tensor  # (B, nh, capacity, hs)
    values: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, rows: int, config: MHAConfig, capacity: int, device: str) -> ProbeCache:
        shape = (rows, config.n_head, capacity, config.head_size)  # (B, nh, capacity, hs)
        return cls(torch.zeros(shape, device=device), torch.zeros(shape, device=device))


class SelfCheck:
    """A backend serves only if it matches the float64 reference on a probe input, and, if it
    computes decode steps, on a prefix and a step after it against the same reference."""

    def __init__(self, config: MHAConfig, weights: Weights, tolerance: float = SELF_CHECK_TOLERANCE) -> None:
        gen = torch.Generator().manual_seed(1234)
        T = min(config.max_seq_len, 33)
        x = torch.randn(2, T, config.d_model, generator=gen)  # (B, T, C)
        self.x = x.numpy()
        self.reference = attention_view(x, weights, config)
        self.tolerance = tolerance
        self.config, self.weights = config, weights  # what the reference computes with (and the audit)

    def error(self, backend: Backend) -> float:
        y = np.asarray(backend.run(self.x))
        if y.shape != self.x.shape:
            raise BackendLoadError(f"{backend.name} returned shape {y.shape} for input {self.x.shape}")
        return relative_error(torch.from_numpy(y), self.reference)

    def step_error(self, backend: Backend) -> float:
        """The prefix of all but the last 3 tokens as one step, then the last 3 as another."""
        B, T, _ = self.x.shape
        cache = ProbeCache.empty(B, self.config, T, backend.device)
        cut = max(T - 3, 1) if T > 1 else 0
        ys = []
        for x in (self.x[:, :cut], self.x[:, cut:]):
            if x.shape[1] == 0:
                continue
            (y,) = backend.step([Step(cache, x)])
            if y.shape != x.shape:
                raise BackendLoadError(f"{backend.name} returned shape {y.shape} for a step of {x.shape}")
            ys.append(np.asarray(y))
            cache.length += x.shape[1]
        return relative_error(torch.from_numpy(np.concatenate(ys, axis=1)), self.reference)

    def passes(self, backend: Backend) -> tuple[bool, str]:
        try:
            err = self.error(backend)
            step_err = self.step_error(backend) if backend.steps else None
        except Exception as exc:  # any failure of a backend under probe disqualifies it
            return False, f"self-check raised {type(exc).__name__}: {exc}"
        for what, e in (("", err), (" of decode steps", step_err)):
            if e is not None and (not math.isfinite(e) or e > self.tolerance):
                return False, f"self-check{what}: relative error {e:.2e} > {self.tolerance:.0e}"
        steps = f", steps {step_err:.2e}" if step_err is not None else ""
        return True, f"self-check relative error {err:.2e}{steps}"


def _factories(spec: BackendSpec, cuda: bool, one_thread: dict[str, int]) -> dict[str, Callable[[], Backend]]:
    from service.backends.ort import OrtCpuBackend, OrtCudaBackend
    from service.backends.pytorch import TorchBackend

    s = spec
    factories: dict[str, Callable[[], Backend]] = {}
    if cuda:
        factories["ort-cuda"] = lambda: OrtCudaBackend(
            s.onnx_path, mem_limit_mb=s.gpu_mem_limit_mb, step_paths=s.step_paths
        )
        factories["torch-cuda"] = lambda: TorchBackend(s.config, s.weights, device="cuda", precision=s.precision)
    factories["ort-cpu"] = lambda: OrtCpuBackend(
        s.onnx_path,
        threads=s.threads,
        spinning=s.spinning,
        width=s.config.d_model,
        step_paths=s.step_paths,
        single_max_tokens=one_thread.get("ort-cpu"),
    )
    factories["torch-cpu"] = lambda: TorchBackend(
        s.config,
        s.weights,
        device="cpu",
        threads=s.threads,
        precision=s.precision,
        single_max_tokens=one_thread.get("torch-cpu"),
    )
    return factories


def _wanted(requested: str, cuda: bool) -> list[str]:
    if requested == "auto":
        return ["ort-cuda", "torch-cuda", "ort-cpu", "torch-cpu"] if cuda else ["ort-cpu", "torch-cpu"]
    if requested == "ort-cuda":
        return ["ort-cuda"]
    if requested == "torch":
        return ["torch-cuda"] if cuda else ["torch-cpu"]
    if requested == "ort-cpu":
        return ["ort-cpu"]
    raise ValueError(f"unknown backend {requested!r}; expected one of {BACKEND_CHOICES}")


def probe_shapes(config: MHAConfig) -> list[tuple[int, int]]:
    """(B, T) from a lone client's small request up to a batch of long ones, lightest first: the
    backend that wins the light ones need not win the heavy ones (ORT's CPU attention kernel and
    PyTorch's cross over on some machines; a batch of 1024-token sequences, whose attention ORT
    holds whole and then hands back to the OS, took ORT three times PyTorch's time:
    docs/benchmarks.md)."""
    shapes = [(1, 16), (1, 64), (1, 256), (4, 512), (4, 1024)]
    clipped = [(B, min(T, config.max_seq_len)) for B, T in shapes]
    return list(dict.fromkeys(clipped))  # a short max_seq_len folds shapes together


MARGIN = 0.8  # a challenger must take at most this share of the incumbent's time to displace it


PROBE_BUDGET_S = 0.2  # per shape: light shapes get more rounds, so a noisy moment cannot flip their verdict
LEAST_ROUNDS = 3  # a shape too heavy for more within the budget: the median of 3 runs of each backend
MAX_ROUNDS = 41
PROBE_GAP_S = 0.001  # idle time before each timed run: a server's backend meets a request after a gap, not warm


def measure_interleaved(
    backends: list[Backend], config: MHAConfig, rounds: int = LEAST_ROUNDS, budget_s: float = PROBE_BUDGET_S
) -> list[list[float]]:
    """Per backend, the median time (ms) on each of the probe shapes: at least `rounds` runs
    each, more (up to MAX_ROUNDS) where a round takes less than `budget_s` / `rounds`. Each timed
    run follows PROBE_GAP_S of idleness, as a request in a server follows the gap since the last:
    back to back, with every cache warm, the probe flatters PyTorch's many small dispatches
    (docs/benchmarks.md).

    The backends take turns run by run, in an order that alternates every round, so that a
    burst of load on a shared machine falls on all of them alike.
    """
    rng = np.random.default_rng(0)
    medians: list[list[float]] = [[] for _ in backends]
    for B, T in probe_shapes(config):
        x = rng.standard_normal((B, T, config.d_model), dtype=np.float32)
        runs = [partial(b.run, x) for b in backends]
        for k, ms in enumerate(interleaved_medians(runs, rounds, budget_s, PROBE_GAP_S)):
            medians[k].append(ms)
    return medians


def interleaved_medians(
    runs: Sequence[Callable[[], object]], rounds: int, budget_s: float, gap_s: float
) -> list[float]:
    """The median time (ms) of each of `runs`, taking turns run by run in an order that alternates
    every round: one warm-up each (the first run allocates), then probe_rounds of them, each timed
    run after `gap_s` of idleness."""
    for run in runs:
        run()
    start = time.perf_counter()
    for run in runs:
        run()  # a second: what one round costs
    samples: list[list[float]] = [[] for _ in runs]
    for r in range(probe_rounds(time.perf_counter() - start, rounds, budget_s)):
        for k in range(len(runs)) if r % 2 == 0 else reversed(range(len(runs))):
            if gap_s:
                time.sleep(gap_s)
            start = time.perf_counter()
            runs[k]()
            samples[k].append(time.perf_counter() - start)
    return [statistics.median(s) * 1e3 for s in samples]


def probe_rounds(one_round_s: float, least: int, budget_s: float) -> int:
    """Rounds of a probe shape whose round takes `one_round_s`: as many as fit `budget_s`,
    between `least` and MAX_ROUNDS, and odd, so that the median is one of the samples."""
    fit = int(budget_s / one_round_s) if one_round_s > 0 else MAX_ROUNDS
    return max(least, min(MAX_ROUNDS, fit)) | 1


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def speed_order(times_ms: list[float], margin: float = MARGIN) -> list[int]:
    """Indices in serving order: the preferred (first) backend keeps its place unless another is
    faster by a clear margin, so that the choice does not flip with a noisy measurement."""
    order = list(range(len(times_ms)))
    fastest = min(order, key=lambda k: times_ms[k])
    if times_ms[fastest] < margin * times_ms[0]:
        order.remove(fastest)
        order.insert(0, fastest)
    return order


@dataclass(frozen=True)
class SizeSplit:
    """Serving orders by a batch's work: up to `light_max_mflop`, `light`; above, `heavy`."""

    light_max_mflop: float
    light: list[int]
    heavy: list[int]


SPLIT_MARGIN = 2 / 3  # the light winner gives a heavier shape up only to a backend 1.5x faster there


def split_by_size(
    times_ms: list[list[float]], works_mflop: list[float], margin: float = SPLIT_MARGIN
) -> SizeSplit | None:
    """Where the backend that wins the lightest probe shapes stops winning (`times_ms`: per
    backend, per shape, lightest first; `works_mflop`: each shape's work): the light shapes up to
    there are served in their order, the heavier in theirs, and the boundary lies midway (in
    ratio) between the last light shape and the first heavy one. None when one backend wins
    every shape: a single order serves all.

    The light side ends only where another backend is clearly faster (`margin`): the probe runs
    back to back with warm caches, which flatters PyTorch's many small dispatches: between a
    lone client's requests in a server, PyTorch pays more for them than the probe shows
    (docs/operations.md)."""
    winners = [speed_order([t[s] for t in times_ms], margin)[0] for s in range(len(works_mflop))]
    light = 1
    while light < len(winners) and winners[light] == winners[0]:
        light += 1
    if light == len(winners):
        return None

    def order(shapes: range) -> list[int]:
        return speed_order([geometric_mean([t[s] for s in shapes]) for t in times_ms])

    boundary = math.sqrt(works_mflop[light - 1] * works_mflop[light])
    return SizeSplit(boundary, order(range(light)), order(range(light, len(works_mflop))))


def select_backends(
    spec: BackendSpec,
    requested: str = "auto",
    cuda: bool | None = None,
    measure: Callable[[list[Backend], MHAConfig], list[list[float]]] = measure_interleaved,
    known: Timings | None = None,
) -> Selection:
    """Load every wanted backend, self-check each, and order them.

    The backends of the device that serves (with CUDA: ORT-CUDA and torch-CUDA, the CPU ones
    falling back after them; without: ORT-CPU and torch-CPU) are measured on the probe shapes
    (`measure`: ms per backend and shape) and the faster serves; where one wins the light shapes
    and the other the heavy ones, each serves its own (Selection.light). Decode steps are
    measured the same way among the backends that compute them on that device. What `known`
    holds (another worker's timings of the same model) is taken instead of measured; every
    backend is still loaded and self-checked here.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    config, known, taken = spec.config, known or Timings(), Timings()
    factories = _factories(spec, cuda, known.one_thread)
    check = SelfCheck(config, spec.weights, tolerance=precision_tolerance(spec.precision, config))
    reports = [CandidateReport(name=name, status="unavailable", reason="") for name in _wanted(requested, cuda)]
    loaded = [(backend, report) for report in reports if (backend := _load(report, factories, check)) is not None]
    taken.one_thread = {b.name: b.single_max_tokens for b, _ in loaded if b.device == "cpu"}
    shapes = len(probe_shapes(config))
    fitting = {name: ms for name, ms in known.probes.items() if len(ms) == shapes}  # one per probe shape
    probe = _reused(lambda bs: measure(bs, config), fitting, taken.probes)
    loaded, light = _serving_order(loaded, cuda, lambda race: probe(_backends(race)), config)
    steps = _step_order(loaded, _reused(lambda bs: measure_steps(bs, config), known.steps, taken.steps))
    selection = Selection(_backends(loaded), check, reports, light, steps, taken)
    log.info("backend selection: %s", selection.summary())
    return selection


def _reused(
    measure: Callable[[list[Backend]], list[V]], known: dict[str, V], taken: dict[str, V]
) -> Callable[[list[Backend]], list[V]]:
    """`measure`, unless `known` holds a value for every backend asked of; what was taken,
    measured or known, is kept in `taken` by backend name."""

    def timed(backends: list[Backend]) -> list[V]:
        names = [b.name for b in backends]
        values = [known[name] for name in names] if all(name in known for name in names) else measure(backends)
        taken.update(zip(names, values, strict=True))
        return values

    return timed


def _serving_order(
    loaded: Candidates, cuda: bool, measure: Callable[[Candidates], list[list[float]]], config: MHAConfig
) -> tuple[Candidates, LightRoute | None]:
    """The candidates in serving order: those on the serving device (a GPU when there is one; the
    CPU's cores are the front end's there) raced by `measure`, then the others as they came."""
    race = [c for c in loaded if not cuda or c[0].device.startswith("cuda")] or loaded
    rest = [c for c in loaded if all(c is not r for r in race)]
    light: LightRoute | None = None
    if len(race) > 1:
        race, light = _by_speed(race, measure(race), config)
    else:
        _mark(race, "")
    for _, report in rest:
        report.status = "fallback"
    return race + rest, light


def measure_steps(
    backends: list[Backend], config: MHAConfig, rounds: int = LEAST_ROUNDS, budget_s: float = PROBE_BUDGET_S
) -> list[float]:
    """Per backend, the geometric mean over the probe pasts of its median time (ms) for the next
    token of one sequence: the backends take turns step by step, as measure_interleaved's do."""
    rng = np.random.default_rng(0)
    pasts = list(dict.fromkeys(min(P, config.max_seq_len - 1) for P in (16, 256)))
    medians: list[list[float]] = [[] for _ in backends]
    for P in pasts:
        caches = [ProbeCache.empty(1, config, P + 1, b.device) for b in backends]
        for cache in caches:
            cache.length = P  # the past's values do not change the work
        x = rng.standard_normal((1, 1, config.d_model), dtype=np.float32)
        runs = [partial(b.step, [Step(cache, x)]) for b, cache in zip(backends, caches, strict=True)]
        for k, ms in enumerate(interleaved_medians(runs, rounds, budget_s, gap_s=0.0)):
            medians[k].append(ms)
    return [geometric_mean(m) for m in medians]


def _step_order(loaded: Candidates, measure: Callable[[list[Backend]], list[float]] | None) -> list[Backend]:
    """The backends that compute decode steps on the device of the first of them (the caches live
    there: a fallback must reach them), fastest first by `measure` (None: in the chain's order)."""
    able = [(b, r) for b, r in loaded if b.steps]
    if not able:
        return []
    able = [(b, r) for b, r in able if b.device == able[0][0].device]
    if measure is not None and len(able) > 1:
        times = measure([b for b, _ in able])
        for (_, report), ms in zip(able, times, strict=True):
            report.reason += f", step {ms:.3f} ms"
        able = [able[k] for k in speed_order(times)]
    able[0][1].reason += " (serves decode steps)"
    return [b for b, _ in able]


Candidates = list[tuple[Backend, CandidateReport]]


def _backends(loaded: Candidates) -> list[Backend]:
    return [backend for backend, _ in loaded]


def _load(report: CandidateReport, factories: dict[str, Callable[[], Backend]], check: SelfCheck) -> Backend | None:
    """The candidate `report` names, loaded and self-checked; None (and the report says why) if it cannot serve."""
    factory = factories.get(report.name)
    if factory is None:  # a CUDA backend asked for where torch sees no CUDA device
        report.reason = "failed to load: needs a CUDA device, and torch sees none (no GPU, driver or CUDA build)"
        log.warning("backend %s unavailable: %s", report.name, report.reason)
        return None
    try:
        backend = factory()
    except (BackendLoadError, RuntimeError, OSError) as exc:
        report.reason = f"failed to load: {exc}"
        log.warning("backend %s unavailable: %s", report.name, exc)
        return None
    ok, why = check.passes(backend)
    if not ok:
        report.status, report.reason = "failed-self-check", why
        log.warning("backend %s rejected: %s", report.name, why)
        backend.close()
        return None
    report.reason = why + (f", {backend.placement}" if hasattr(backend, "placement") else "")
    return backend


def _mark(loaded: Candidates, why_first: str) -> None:
    """The first serves, the rest fall back; `why_first` is said of the first when others exist."""
    for i, (_, report) in enumerate(loaded):
        report.status = "serving" if i == 0 else "fallback"
        if i == 0 and len(loaded) > 1 and why_first:
            report.reason += f" ({why_first})"


def _by_speed(
    loaded: Candidates, times_ms: list[list[float]], config: MHAConfig
) -> tuple[Candidates, LightRoute | None]:
    """The candidates in serving order by what was measured, and the light batches' own order
    when another backend wins them."""
    shapes = probe_shapes(config)
    means = [geometric_mean(per_shape) for per_shape in times_ms]
    for (_, report), per_shape, mean in zip(loaded, times_ms, means, strict=True):
        report.probe_ms = mean
        each = ", ".join(f"{shape} {ms:.3f}" for shape, ms in zip(shapes, per_shape, strict=True))
        report.reason += f", probe {report.probe_ms:.3f} ms ({each})"
    preferred = loaded[0][1].name
    split = split_by_size(times_ms, [batch_mflop(B, T, config.d_model) for B, T in shapes])
    if split is None:
        ordered = [loaded[k] for k in speed_order(means)]
        _mark(ordered, _why(ordered[0][1].name, preferred))
        return ordered, None
    ordered = [loaded[k] for k in split.heavy]
    _mark(ordered, f"batches over {split.light_max_mflop:.0f} MFLOP")
    first_light = loaded[split.light[0]][1]
    first_light.status = "serving"
    first_light.reason += f" (batches of at most {split.light_max_mflop:.0f} MFLOP)"
    return ordered, LightRoute(split.light_max_mflop, [loaded[k][0] for k in split.light], config.d_model)


def _why(serving: str, preferred: str) -> str:
    if serving == preferred:
        return f"preferred; no other is faster by {1 / MARGIN - 1:.0%}"
    return f"faster than {preferred} by more than {1 / MARGIN - 1:.0%}"
