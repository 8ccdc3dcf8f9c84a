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
    onnx_path: Path, config: MHAConfig, weights: Weights, threads: int, cuda: bool, spinning: bool
) -> dict[str, Callable[[], Backend]]:
    from service.backends.ort import OrtCpuBackend, OrtCudaBackend
    from service.backends.pytorch import TorchBackend

    factories: dict[str, Callable[[], Backend]] = {}
    if cuda:
        factories["ort-cuda"] = lambda: OrtCudaBackend(onnx_path)
        factories["torch-cuda"] = lambda: TorchBackend(config, weights, device="cuda")
    factories["ort-cpu"] = lambda: OrtCpuBackend(onnx_path, threads=threads, spinning=spinning)
    factories["torch-cpu"] = lambda: TorchBackend(config, weights, device="cpu", threads=threads)
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


def measure(backend: Backend, config: MHAConfig, repeats: int = 5) -> float:
    """Geometric mean over the probe shapes of the median time, in milliseconds."""
    rng = np.random.default_rng(0)
    logs = []
    for B, T in probe_shapes(config):
        x = rng.standard_normal((B, T, config.d_model), dtype=np.float32)
        backend.run(x)  # warm-up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.run(x)
            samples.append(time.perf_counter() - start)
        logs.append(math.log(statistics.median(samples) * 1e3))
    return math.exp(sum(logs) / len(logs))


def select_backends(
    onnx_path: Path,
    config: MHAConfig,
    weights: Weights,
    requested: str = "auto",
    threads: int = 1,
    cuda: bool | None = None,
    spinning: bool = False,
) -> Selection:
    """Load every wanted backend, self-check each, and order them.

    With CUDA, the order is fixed (ORT-CUDA, torch-CUDA, then CPU). Without, ORT-CPU and
    torch-CPU are measured on the probe shapes and the faster serves.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    factories = _factories(onnx_path, config, weights, threads, cuda, spinning)
    check = SelfCheck(config, weights)
    loaded: list[tuple[Backend, CandidateReport]] = []
    reports: list[CandidateReport] = []
    for name in _wanted(requested, cuda):
        report = CandidateReport(name=name, status="unavailable", reason="")
        reports.append(report)
        try:
            backend = factories[name]()
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
        report.reason = why
        loaded.append((backend, report))
    if not cuda and len(loaded) > 1:
        for backend, report in loaded:
            report.probe_ms = measure(backend, config)
            report.reason += f", probe {report.probe_ms:.3f} ms"
        loaded.sort(key=lambda pair: pair[1].probe_ms or math.inf)
    for i, (_, report) in enumerate(loaded):
        report.status = "serving" if i == 0 else "fallback"
        if i == 0 and len(loaded) > 1:
            report.reason += " (first in order)" if cuda else " (fastest on this machine)"
    selection = Selection(backends=[b for b, _ in loaded], check=check, candidates=reports)
    log.info("backend selection: %s", selection.summary())
    return selection
