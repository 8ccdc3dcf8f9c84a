"""Answers re-verified in production. A sampled share of the stateless answers (`--audit-rate`) is
recomputed off the hot path by the float64 reference and compared with what was served, at the
precision's tolerance (the self-check's). An input whose attention scores are large costs any
computation in the served format more than that (fp32: standard normal inputs times 100 come to
4e-5, times 300 to 4e-4): an answer beyond the tolerance is a mismatch only when it is also beyond
ROUNDING_FACTOR times what rounding the scores in that format moves the answer, to first order, on
that input (`score_rounding_error`).

A mismatch is an incident. It is counted and logged once, with the request id, the shape, the
backend, the error and the tolerance. The backend is quarantined at once, as repeated errors quarantine it,
so the fallback chain takes over until its probe (the self-check) passes again.

It never costs a client. The answer is sent before its audit. The audit copies one row of the
request and its answer (a causal model's prefix of up to `--audit-max-tokens` tokens is exact on
its own, as padding is), into a bounded queue. A full queue, a spent CPU allowance
(`--audit-max-cpu`, measured as the audit thread's wall time, which overstates it) or a full
batch waiting (unless `--audit-when-busy`) skips the audit, and the skip is counted. At rate 1
(every answer, asked for) only the queue's bound applies. Decode steps
are not audited: the server keeps their keys and values, not the prefix the reference would need.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from export.layout import UNIT_ROUNDOFF
from model import MHAConfig
from model.reference import attention_view, relative_error, score_rounding_error
from service.errors import quote
from service.metrics import AUDIT_SKIPS

__all__ = ["AUDIT_SKIPS", "AuditLimits", "Auditor", "Check", "Reference", "Sample", "mismatch_message"]

if TYPE_CHECKING:
    from service.engine.versions import Loaded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditLimits:
    rate: float = 0.001  # share of answers audited; 0: off
    max_cpu: float = 0.05  # share of one CPU the audits may take, on average
    queue: int = 64  # answers waiting for their audit at most
    max_tokens: int = 256  # tokens of one row recomputed
    when_busy: bool = False  # audit even while a full batch waits
    busy_depth: int = 8  # requests waiting that make a full batch (--max-batch-size)


ROUNDING_FACTOR = 8.0  # fp32 answers beyond 1e-5 measured at most 1.11x the estimate (docs/operations.md)


@dataclass(frozen=True)
class Check:
    """One audit's verdict: the served answer's relative error, and the error allowed on its input."""

    error: float
    allowed: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.allowed


class Reference:
    """One version's float64 reference: its weights converted once, the tolerance of the precision
    it serves and that format's unit roundoff."""

    def __init__(
        self, config: MHAConfig, weights: Mapping[str, torch.Tensor], tolerance: float, precision: str = "fp32"
    ) -> None:
        self.config, self.tolerance, self.roundoff = config, tolerance, UNIT_ROUNDOFF[precision]
        self.weights = {name: w.to(torch.float64) for name, w in weights.items()}

    def check(self, x: np.ndarray, y: np.ndarray) -> Check:
        """The served (1, T, C) `y` against the reference on `x`."""
        with torch.no_grad():
            ref = attention_view(torch.from_numpy(x), self.weights, self.config)  # (1, T, C) float64
            error = relative_error(torch.from_numpy(y), ref)
            if not error > self.tolerance:  # within it, or NaN: the scores change neither verdict
                return Check(error, self.tolerance)
            rounding = score_rounding_error(torch.from_numpy(x), self.weights, self.config)
            return Check(error, max(self.tolerance, ROUNDING_FACTOR * self.roundoff * rounding))


@dataclass(frozen=True)
class Sample:
    """What one audit checks: a row of the request (a prefix) and of its answer, and who served it."""

    x: np.ndarray  # (1, T', C) copy
    y: np.ndarray  # (1, T', C) copy
    shape: tuple[int, ...]  # the request's (B, T, C)
    backend: str
    request_id: str
    version: str
    device: str  # the backend's
    precision: str  # the version's
    quarantine: Callable[[str], None]  # quarantines a backend of the version's chain, by name


Verdict = Callable[[Sample, Check, float], None]  # (sample, its verdict, seconds)


class Allowance:
    """What bounds the audit: the audits queued (memory), and the CPU time it may spend (a bucket
    refilled at `max_cpu` seconds per second). Shared by the event loop and the audit thread."""

    def __init__(self, limits: AuditLimits, clock: Callable[[], float]) -> None:
        self.limits, self._clock = limits, clock
        self._lock = threading.Lock()  # the two below
        self._pending = 0
        self._seconds, self._refilled = limits.max_cpu, clock()  # seconds of audit time available

    def take(self, every: bool) -> str:
        """One audit queued (""), or why not: the queue is full, or the CPU allowance spent (unless
        `every` answer was asked for: then only the queue's bound applies)."""
        with self._lock:
            now = self._clock()
            self._seconds = min(self.limits.max_cpu, self._seconds + (now - self._refilled) * self.limits.max_cpu)
            self._refilled = now
            if self._pending >= self.limits.queue:
                return "queue_full"
            if self._seconds <= 0 and not every:
                return "cpu"
            self._pending += 1
        return ""

    def spent(self, seconds: float) -> None:
        """An audit done, after `seconds` of the audit thread."""
        with self._lock:
            self._pending -= 1
            self._seconds -= seconds


class Auditor:
    """Samples answers on the event loop (`offer`, O(1) unless sampled) and checks them on a
    thread of its own; `on_checked` hears every verdict, `on_skipped` every skip's reason."""

    def __init__(
        self,
        limits: AuditLimits,
        on_checked: Verdict,
        on_skipped: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.limits, self._on_checked, self._on_skipped = limits, on_checked, on_skipped
        self._timer = timer  # what an audit's cost is measured with
        self._credit = 1.0 - limits.rate  # the rate accumulated: the first answer, then every 1/rate-th
        self._rows = 0  # which row of a request the next audit takes, in turn
        self._allowance = Allowance(limits, clock)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit")

    def offer(self, x: np.ndarray, y: np.ndarray, backend: str, request_id: str, loaded: Loaded) -> str | None:
        """An answer (B, T, C) of version `loaded` served by `backend`: queued for its audit (None),
        skipped (the reason, counted), or not sampled ("")."""
        reference = loaded.reference
        if reference is None:  # the audit is off
            return ""
        self._credit += self.limits.rate
        if self._credit < 1.0:
            return ""
        self._credit -= 1.0
        reason = self._skip(x.shape, reference.config.causal, loaded.batcher.depth >= self.limits.busy_depth)
        if reason:
            self._on_skipped(reason)
            return reason
        row, tokens = self._rows % x.shape[0], min(x.shape[1], self.limits.max_tokens)
        self._rows += 1
        x1, y1 = x[row : row + 1, :tokens].copy(), y[row : row + 1, :tokens].copy()  # (1, T', C)
        chain = loaded.chain  # resolved here, on the event loop, not on the audit thread
        device = next((b.device for b in chain.backends if b.name == backend), "unknown")
        sample = Sample(
            x1, y1, x.shape, backend, request_id, loaded.version, device, loaded.model.precision, chain.quarantine.enter
        )
        self._thread.submit(self._check, sample, reference)
        return None

    def _skip(self, shape: tuple[int, ...], causal: bool, busy: bool) -> str:
        """Why a sampled answer is not audited ("" : it is). At rate 1 every answer was asked for:
        only the queue's bound (memory) applies, not the CPU allowance nor the busy check."""
        every = self.limits.rate >= 1.0
        if busy and not (self.limits.when_busy or every):
            return "busy"
        if not causal and shape[1] > self.limits.max_tokens:  # without causality no prefix stands alone
            return "too_large"
        return self._allowance.take(every)

    def _check(self, sample: Sample, reference: Reference) -> None:
        began = self._timer()
        try:
            check: Check | None = reference.check(sample.x, sample.y)
        except Exception:  # the audit's own failure is logged, never a client's
            log.exception("audit of request %s failed", quote(sample.request_id))
            check = None
        spent = self._timer() - began
        self._allowance.spent(spent)
        if check is not None:
            self._on_checked(sample, check, spent)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def mismatch_message(sample: Sample, check: Check) -> str:
    return (
        f"audit: the answer to request {quote(sample.request_id)} (shape {sample.shape}, version "
        f"{quote(sample.version)}) from {sample.backend} differs from the float64 reference: relative error "
        f"{check.error:.2e} > {check.allowed:.1e} over a row's first {sample.x.shape[1]} tokens; {sample.backend} "
        "is quarantined until its self-check passes again"
    )
