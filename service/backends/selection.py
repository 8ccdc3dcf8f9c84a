"""Which backends serve, in which order, and why: load, self-check, measure."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from export.layout import precision_tolerance
from model import MHAConfig
from model.checkpoint import Weights
from model.reference import attention_view, relative_error
from service.backends.base import Backend, BackendLoadError
from service.settings import BACKEND_CHOICES

log = logging.getLogger(__name__)

SELF_CHECK_TOLERANCE = 1e-5  # relative, against the float64 reference


@dataclass
class CandidateReport:
    name: str
    status: str  # "serving", "fallback", "unavailable", "failed-self-check"
    reason: str
    probe_ms: float | None = None  # geometric mean of the probe medians, where measured


@dataclass
class Selection:
    backends: list[Backend]  # serving order: the first serves, the rest are the fallback chain
    check: SelfCheck  # what each backend passed; the chain probes benched backends with it
    candidates: list[CandidateReport] = field(default_factory=list)

    def summary(self) -> str:
        return "; ".join(f"{c.name}: {c.status} ({c.reason})" for c in self.candidates)


class SelfCheck:
    """A backend serves only if it matches the float64 reference on a probe input."""

    def __init__(self, config: MHAConfig, weights: Weights, tolerance: float = SELF_CHECK_TOLERANCE) -> None:
        gen = torch.Generator().manual_seed(1234)
        T = min(config.max_seq_len, 33)
        x = torch.randn(2, T, config.d_model, generator=gen)  # (B, T, C)
        self.x = x.numpy()
        self.reference = attention_view(x, weights, config)
        self.tolerance = tolerance

    def error(self, backend: Backend) -> float:
        y = np.asarray(backend.run(self.x))
        if y.shape != self.x.shape:
            raise BackendLoadError(f"{backend.name} returned shape {y.shape} for input {self.x.shape}")
        return relative_error(torch.from_numpy(y), self.reference)

    def passes(self, backend: Backend) -> tuple[bool, str]:
        try:
            err = self.error(backend)
        except Exception as exc:  # any failure of a backend under probe disqualifies it
            return False, f"self-check raised {type(exc).__name__}: {exc}"
        if not math.isfinite(err) or err > self.tolerance:
            return False, f"self-check relative error {err:.2e} > {self.tolerance:.0e}"
        return True, f"self-check relative error {err:.2e}"


def _factories(
    onnx_path: Path,
    config: MHAConfig,
    weights: Weights,
    threads: int,
    cuda: bool,
    spinning: bool,
    gpu_mem_limit_mb: int = 0,
    precision: str = "fp32",
    lone_spinning: bool = False,
) -> dict[str, Callable[[], Backend]]:
    from service.backends.ort import OrtCpuBackend, OrtCudaBackend
    from service.backends.pytorch import TorchBackend

    factories: dict[str, Callable[[], Backend]] = {}
    if cuda:
        factories["ort-cuda"] = lambda: OrtCudaBackend(onnx_path, mem_limit_mb=gpu_mem_limit_mb)
        factories["torch-cuda"] = lambda: TorchBackend(config, weights, device="cuda", precision=precision)
    factories["ort-cpu"] = lambda: OrtCpuBackend(
        onnx_path, threads=threads, spinning=spinning, width=config.d_model, lone_spinning=lone_spinning
    )
    factories["torch-cpu"] = lambda: TorchBackend(config, weights, device="cpu", threads=threads, precision=precision)
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
    return [(1, min(64, config.max_seq_len)), (4, min(512, config.max_seq_len))]


MARGIN = 0.8  # a challenger must take at most this share of the incumbent's time to displace it


def measure_interleaved(backends: list[Backend], config: MHAConfig, rounds: int = 7) -> list[float]:
    """Per backend, the geometric mean over the probe shapes of the median time (ms).

    The backends take turns run by run, in an order that alternates every round, so that a
    burst of load on a shared machine falls on all of them alike.
    """
    rng = np.random.default_rng(0)
    logs: list[list[float]] = [[] for _ in backends]
    for B, T in probe_shapes(config):
        x = rng.standard_normal((B, T, config.d_model), dtype=np.float32)
        samples: list[list[float]] = [[] for _ in backends]
        for backend in backends:
            backend.run(x)  # warm-up
        for r in range(rounds):
            order = range(len(backends)) if r % 2 == 0 else reversed(range(len(backends)))
            for k in order:
                start = time.perf_counter()
                backends[k].run(x)
                samples[k].append(time.perf_counter() - start)
        for k in range(len(backends)):
            logs[k].append(math.log(statistics.median(samples[k]) * 1e3))
    return [math.exp(sum(ls) / len(ls)) for ls in logs]


def speed_order(times_ms: list[float], margin: float = MARGIN) -> list[int]:
    """Indices in serving order: the preferred (first) backend keeps its place unless another is
    faster by a clear margin, so that the choice does not flip with a noisy measurement."""
    order = list(range(len(times_ms)))
    fastest = min(order, key=lambda k: times_ms[k])
    if times_ms[fastest] < margin * times_ms[0]:
        order.remove(fastest)
        order.insert(0, fastest)
    return order


def select_backends(
    onnx_path: Path,
    config: MHAConfig,
    weights: Weights,
    requested: str = "auto",
    threads: int = 1,
    cuda: bool | None = None,
    spinning: bool = False,
    gpu_mem_limit_mb: int = 0,
    precision: str = "fp32",
    measure: Callable[[list[Backend], MHAConfig], list[float]] = measure_interleaved,
    lone_spinning: bool = False,
) -> Selection:
    """Load every wanted backend, self-check each, and order them.

    With CUDA, the order is fixed (ORT-CUDA, torch-CUDA, then CPU). Without, ORT-CPU and
    torch-CPU are measured on the probe shapes (`measure`: ms per backend) and the faster serves.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    factories = _factories(
        onnx_path, config, weights, threads, cuda, spinning, gpu_mem_limit_mb, precision, lone_spinning
    )
    check = SelfCheck(config, weights, tolerance=precision_tolerance(precision, config))
    loaded: list[tuple[Backend, CandidateReport]] = []
    reports: list[CandidateReport] = []
    for name in _wanted(requested, cuda):
        report = CandidateReport(name=name, status="unavailable", reason="")
        reports.append(report)
        factory = factories.get(name)
        if factory is None:  # a CUDA backend asked for where torch sees no CUDA device
            report.reason = "failed to load: needs a CUDA device, and torch sees none (no GPU, driver or CUDA build)"
            log.warning("backend %s unavailable: %s", name, report.reason)
            continue
        try:
            backend = factory()
        except (BackendLoadError, RuntimeError, OSError) as exc:
            report.reason = f"failed to load: {exc}"
            log.warning("backend %s unavailable: %s", name, exc)
            continue
        ok, why = check.passes(backend)
        if not ok:
            report.status, report.reason = "failed-self-check", why
            log.warning("backend %s rejected: %s", name, why)
            backend.close()
            continue
        report.reason = why + (f", {backend.placement}" if hasattr(backend, "placement") else "")
        loaded.append((backend, report))
    preferred = loaded[0][1].name if loaded else ""
    if not cuda and len(loaded) > 1:
        times = measure([b for b, _ in loaded], config)
        for (_, report), ms in zip(loaded, times, strict=True):
            report.probe_ms = ms
            report.reason += f", probe {ms:.3f} ms"
        loaded = [loaded[k] for k in speed_order(times)]
    for i, (_, report) in enumerate(loaded):
        report.status = "serving" if i == 0 else "fallback"
        if i == 0 and len(loaded) > 1:
            if cuda:
                report.reason += " (first in order)"
            elif report.name == preferred:
                report.reason += f" (preferred; no other is faster by {1 / MARGIN - 1:.0%})"
            else:
                report.reason += f" (faster than {preferred} by more than {1 / MARGIN - 1:.0%})"
    selection = Selection(backends=[b for b, _ in loaded], check=check, candidates=reports)
    log.info("backend selection: %s", selection.summary())
    return selection
