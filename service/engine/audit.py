"""Answers re-verified in production. A sampled share of the answers (`--audit-rate`), stateless
and decode steps alike, is recomputed off the hot path by the float64 reference and compared with
what was served, at the precision's tolerance (the self-check's). An input whose attention scores
are large costs any computation in the served format more than that (fp32: standard normal inputs
times 100 come to 4e-5, times 300 to 4e-4): an answer beyond the tolerance is a mismatch only when
it is also beyond what rounding at ROUNDING_FACTOR times the format's unit moves the answer on that
input: the scores' share (`score_rounding_error`, not only to first order: huge scores that nearly
tie can swap), and the linear layers' (`linear_rounding_error`: an input made to answer near zero
is answered as exactly as the format allows, yet far off relative to that zero, and is no fault).

A decode step is checked against the keys and values its sequence holds after it: the rows the
step wrote must be its own tokens' keys and values, and its answer that of its tokens attending to
the held past as it is (each earlier step's rows were checked when that step was, if sampled).

A mismatch is an incident. It is counted and logged once, with the request id, the shape, the
backend, the error and the tolerance. The backend is quarantined at once, as repeated errors quarantine it,
so the fallback chain takes over until its probe (the self-check) passes again. Every live sequence
of the version whose steps that backend computed is dropped too, the audited step's own and
others alike: keys and values it wrote at steps not sampled may be wrong as well, and every later
step would attend to them. Their next steps are refused NOT_FOUND, saying why, and the clients
start them again with their prefixes.

Which tokens: one row of the request, rows in turn, and of it a window of up to
`--audit-max-tokens` tokens, windows in turn along the row, so that over many answers every
position of a long one is checked. The window's answers are checked against the reference on the
tokens they depend on: a causal model's row up to the window's end (not the tokens after it, as
with padding), a non-causal model's whole row. The other tokens are only projected to keys and
values, so a window's cost grows with the row's length linearly, not squared. A step's window is
of its new tokens, with every key and value they attend to.

It never costs a client. The answer is sent before its audit. The audit copies what it checks into
a bounded queue. A full queue (`--audit-queue` answers, or `--audit-queue` times 2
`--audit-max-tokens` token rows), a spent CPU allowance (`--audit-max-cpu`, measured as the audit
thread's wall time, which overstates it) or a full batch waiting (unless `--audit-when-busy`)
skips the audit, and the skip is counted. At rate 1 (every answer, asked for) only the queue's
bound applies.
"""

from __future__ import annotations

import asyncio
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
from model.reference import (
    attention_view,
    heads,
    linear_rounding_error,
    relative_error,
    score_rounding_error,
    split_heads,
    term_magnitudes,
)
from service.errors import AnswerRejected, SequenceNotFound, quote
from service.metrics import AUDIT_SKIPS

__all__ = [
    "AUDIT_SKIPS",
    "Audit",
    "AuditLimits",
    "Auditor",
    "Check",
    "Gate",
    "Reference",
    "Sample",
    "distrusted",
    "mismatch_message",
]

if TYPE_CHECKING:
    from service.decode.sequences import LiveSequence, SequenceStore
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


Cache = tuple[np.ndarray, np.ndarray]  # a step's row of keys and values after it, (1, nh, P + t, hs) each
ROUNDING_FACTOR = 8.0  # the estimates at 8 u: fp32 answers came within 0.04x of them (docs/operations.md)


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

    def check(self, x: np.ndarray, y: np.ndarray, cache: Cache | None = None, first: int | None = None) -> Check:
        """The served (1, w, C) `y` against the reference: the answers to `x`'s w tokens from
        `first` (by default its last w), its other tokens attended to (a causal row's tokens before
        them; a non-causal row's before and after). For a decode step, `cache` holds the keys and
        values as the step left them: the last w rows must be the window's own, and `y` is that of
        its tokens attending to the rows before them as given."""
        with torch.no_grad():
            first = x.shape[1] - y.shape[1] if first is None else first
            end = first + y.shape[1]
            x64, past, past_terms = torch.from_numpy(x[:, first:end]), None, None
            if cache is not None:
                if not (written := self._written(x64, cache)).passed:
                    return written
                P = cache[0].shape[2] - x64.shape[1]
                past = (torch.from_numpy(cache[0][:, :, :P]), torch.from_numpy(cache[1][:, :, :P]))
            elif end - first < x.shape[1]:  # the other tokens' keys and values (order is the mask's concern)
                past, past_terms = self._others(torch.from_numpy(np.concatenate([x[:, :first], x[:, end:]], axis=1)))
            ref = attention_view(x64, self.weights, self.config, past)  # (1, w, C) float64
            error = relative_error(torch.from_numpy(y), ref)
            if not error > self.tolerance:  # within it, or NaN: the scores change neither verdict
                return Check(error, self.tolerance)
            roundoff = ROUNDING_FACTOR * self.roundoff
            scores = score_rounding_error(x64, self.weights, self.config, past, roundoff)
            terms = roundoff * linear_rounding_error(x64, self.weights, self.config, past, past_terms)
            return Check(error, max(self.tolerance, scores + terms))

    def _others(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The keys and values of a row's tokens outside a window, as the served graph computes
        them from the tokens, and the size of the values' terms (1, nh, P, hs): rounded at that size."""
        past = (heads(x, self.weights, self.config, "k_proj"), heads(x, self.weights, self.config, "v_proj"))
        return past, split_heads(term_magnitudes(x, self.weights, "v_proj"), self.config)  # (1, nh, P, hs)

    def _written(self, x: torch.Tensor, cache: Cache) -> Check:
        """The keys and values a step wrote against its tokens' own: within the tolerance, or
        within ROUNDING_FACTOR u times the size of the terms their sums add (terms that cancel)."""
        P = cache[0].shape[2] - x.shape[1]
        for held, name in zip(cache, ("k_proj", "v_proj"), strict=True):
            ref = heads(x, self.weights, self.config, name)  # (1, nh, T, hs)
            error = relative_error(torch.from_numpy(held[:, :, P:]), ref)
            terms = float(term_magnitudes(x, self.weights, name).norm()) / max(float(ref.norm()), 1e-300)
            check = Check(error, max(self.tolerance, ROUNDING_FACTOR * self.roundoff * terms))
            if not check.passed:
                return check
        return check


@dataclass(frozen=True)
class Sample:
    """What one audit checks: a row of the request, the answers of a window of it, and who served them."""

    x: np.ndarray  # (1, T', C) copy: the row up to the window's end (a non-causal model's: all of it)
    y: np.ndarray  # (1, w, C) copy: the window's answers
    first: int  # the window's first token in x
    shape: tuple[int, ...]  # the request's (B, T, C)
    backend: str
    request_id: str
    version: str
    device: str  # the backend's
    precision: str  # the version's
    quarantine: Callable[[str], int]  # quarantines a backend of the chain by name: the times found wrong (0: again)
    cache: Cache | None = None  # a decode step's keys and values after it
    sequences: SequenceStore | None = None  # the version's live sequences (the event loop's)
    held: bool = False  # the answer waits for this check before it is sent (--audit-before-answer)

    @property
    def past(self) -> int | None:
        """A decode step's tokens before it (None: a stateless answer)."""
        return None if self.cache is None else self.cache[0].shape[2] - self.first - self.y.shape[1]

    @property
    def window(self) -> tuple[int, int]:
        """The tokens audited, [first, last], of the request's row (a step's: of its new tokens)."""
        return self.first, self.first + self.y.shape[1] - 1

    @property
    def rows(self) -> int:
        """The token rows it holds: the row's, the window's answers, a step's keys and values."""
        return self.x.shape[1] + self.y.shape[1] + (0 if self.cache is None else 2 * self.cache[0].shape[2])


OnChecked = Callable[[Sample, Check, float], None]  # (sample, its verdict, seconds)


class Allowance:
    """What bounds the audit: the audits queued and the token rows they hold (memory), and the CPU
    time it may spend (a bucket refilled at `max_cpu` seconds per second). Shared by the event
    loop and the audit thread."""

    def __init__(self, limits: AuditLimits, clock: Callable[[], float]) -> None:
        self.limits, self._clock = limits, clock
        self._lock = threading.Lock()  # the three below
        self._pending = self._rows = 0
        self._seconds, self._refilled = limits.max_cpu, clock()  # seconds of audit time available

    def take(self, every: bool, rows: int) -> str:
        """One audit of `rows` token rows queued (""), or why not: it is larger than the whole
        queue, the queue is full, or the CPU allowance spent (unless `every` answer was asked for:
        then only the queue's bound applies). The queue holds `queue` audits, and at most the rows
        of that many first windows (a late window's row, or a step's keys and values, hold more)."""
        bound = self.limits.queue * 2 * self.limits.max_tokens
        if rows > bound:
            return "too_large"
        with self._lock:
            now = self._clock()
            self._seconds = min(self.limits.max_cpu, self._seconds + (now - self._refilled) * self.limits.max_cpu)
            self._refilled = now
            if self._pending >= self.limits.queue or self._rows + rows > bound:
                return "queue_full"
            if self._seconds <= 0 and not every:
                return "cpu"
            self._pending, self._rows = self._pending + 1, self._rows + rows
        return ""

    def spent(self, seconds: float, rows: int) -> None:
        """An audit of `rows` done, after `seconds` of the audit thread."""
        with self._lock:
            self._pending, self._rows = self._pending - 1, self._rows - rows
            self._seconds -= seconds


class Auditor:
    """Samples answers on the event loop (`offer`, `offer_step`: O(1) unless sampled) and checks
    them on a thread of its own; `on_checked` hears every verdict, `on_skipped` every skip's reason."""

    def __init__(
        self,
        limits: AuditLimits,
        on_checked: OnChecked,
        on_skipped: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.limits, self._on_checked, self._on_skipped = limits, on_checked, on_skipped
        self._timer = timer  # what an audit's cost is measured with
        self._credit = 1.0 - limits.rate  # the rate accumulated: the first answer, then every 1/rate-th
        self._turn = 0  # which row of a request, and which window of the row, the next audit takes
        self._allowance = Allowance(limits, clock)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit")

    def offer(self, x: np.ndarray, y: np.ndarray, backend: str, request_id: str, loaded: Loaded) -> str | None:
        """An answer (B, T, C) of version `loaded` served by `backend`: queued for its audit (None),
        skipped (the reason, counted), or not sampled ("")."""
        reference = loaded.reference
        if reference is None or not self._sampled():
            return ""
        row, first, end = self._place(*x.shape[:2])
        whole = end if reference.config.causal else x.shape[1]  # the tokens the window's answers depend on
        if reason := self._take(loaded.batcher.depth, whole + end - first):
            return self._skipped(reason)
        answer = (x[row : row + 1, :whole].copy(), y[row : row + 1, first:end].copy())  # (1, T', C), (1, w, C)
        sample = sample_of(loaded, answer, first, None, x.shape, backend, request_id)
        self._thread.submit(self._check, sample, reference)
        return None

    def offer_step(
        self, x: np.ndarray, y: np.ndarray, cache: LiveSequence, backend: str, request_id: str, loaded: Loaded
    ) -> str | None:
        """A decode step's answer (B, t, C), `cache` its sequence after it (holding `cache.length`
        tokens, the step's last): as `offer`. A window of its new tokens is audited with every key
        and value they attend to, copied now (a later step of the sequence writes past them)."""
        reference = loaded.reference
        if reference is None or not self._sampled():
            return ""
        row, first, end = self._place(*x.shape[:2])
        held = cache.length - x.shape[1] + end  # the past, and the new tokens up to the window's end
        if reason := self._take(loaded.decoder.steps.depth, end + end - first + 2 * held):
            return self._skipped(reason)
        answer = (x[row : row + 1, :end].copy(), y[row : row + 1, first:end].copy())  # (1, end, C), (1, w, C)
        keys, values = (
            c[row : row + 1, :, :held].cpu().numpy().copy() for c in (cache.keys, cache.values)
        )  # (1, nh, P + end, hs)
        sample = sample_of(loaded, answer, first, (keys, values), x.shape, backend, request_id)
        self._thread.submit(self._check, sample, reference)
        return None

    async def answered(self, x: np.ndarray, y: np.ndarray, backend: str, request_id: str, loaded: Loaded) -> None:
        """The door's call for every answer before it goes: sampled here for an audit after it
        (`Gate.answered` checks it before instead)."""
        self.offer(x, y, backend, request_id, loaded)

    async def answered_step(
        self, x: np.ndarray, y: np.ndarray, sequence: LiveSequence, backend: str, request_id: str, loaded: Loaded
    ) -> None:
        self.offer_step(x, y, sequence, backend, request_id, loaded)

    def _sampled(self) -> bool:
        self._credit += self.limits.rate
        if self._credit < 1.0:
            return False
        self._credit -= 1.0
        return True

    def _place(self, rows: int, tokens: int) -> tuple[int, int, int]:
        """The row of a request the next audit takes, and its window [first, end) of `max_tokens`
        tokens (the last may be shorter): both in turn, so that over many answers every row and
        every position of long ones is audited."""
        size, turn = self.limits.max_tokens, self._turn
        self._turn += 1
        windows = -(-tokens // size)  # tokens / size rounded up
        first = (turn // rows) % windows * size
        return turn % rows, first, min(first + size, tokens)

    def _skipped(self, reason: str) -> str:
        self._on_skipped(reason)
        return reason

    def _take(self, waiting: int, rows: int) -> str:
        """Why a sampled answer of `rows` token rows is not audited ("" : it is), `waiting`
        requests queued behind its batcher. At rate 1 every answer was asked for: only the queue's
        bound (memory) applies, not the CPU allowance nor the busy check."""
        every = self.limits.rate >= 1.0
        if waiting >= self.limits.busy_depth and not (self.limits.when_busy or every):
            return "busy"
        return self._allowance.take(every, rows)

    def _check(self, sample: Sample, reference: Reference) -> None:
        began = self._timer()
        try:
            check: Check | None = reference.check(sample.x, sample.y, sample.cache, sample.first)
        except Exception:  # the audit's own failure is logged, never a client's
            log.exception("audit of request %s failed", quote(sample.request_id))
            check = None
        spent = self._timer() - began
        self._allowance.spent(spent, sample.rows)
        if check is not None:
            self._on_checked(sample, check, spent)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def sample_of(
    loaded: Loaded,
    answer: tuple[np.ndarray, np.ndarray],
    first: int,
    cache: Cache | None,
    shape: tuple[int, ...],
    backend: str,
    request_id: str,
    held: bool = False,
) -> Sample:
    """What checks `answer`, a row (1, T', C) and its window's answers (1, w, C) from `first`, of
    version `loaded` (on the event loop, which the chain's backends are read on)."""
    chain = loaded.chain
    device = next((b.device for b in chain.backends + chain.step_backends if b.name == backend), "unknown")
    x, y = answer
    who = (backend, request_id, loaded.version, device, loaded.model.precision)
    return Sample(x, y, first, shape, *who, chain.quarantine.enter, cache, loaded.decoder.sequences, held)


class Gate:
    """--audit-before-answer: every answer checked, every token of every row of it, against the
    float64 reference before it is sent, on a thread of its own (the sampled audit is then not
    needed). Rows are checked in windows of `max_tokens` tokens, as the audit's, so that memory
    grows with a row's length linearly. A mismatch is an incident as an audit's (`on_checked`),
    and the request is refused: UNAVAILABLE for a stateless answer (a retry is computed by another
    backend), NOT_FOUND for a step, whose sequence is dropped with every other one that backend
    computed (their clients start them again, as after an audit). The answer found wrong is never
    sent."""

    def __init__(self, on_checked: OnChecked, max_tokens: int, timer: Callable[[], float] = time.perf_counter) -> None:
        self._on_checked, self._max_tokens, self._timer = on_checked, max_tokens, timer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gate")

    def _windows(self, tokens: int) -> range:
        return range(0, tokens, self._max_tokens)  # each window's first token

    async def answered(self, x: np.ndarray, y: np.ndarray, backend: str, request_id: str, loaded: Loaded) -> None:
        """Returns once every window of every row of the answer (B, T, C) passed; raises
        AnswerRejected if one did not."""
        causal, (B, T) = loaded.model.config.causal, x.shape[:2]
        samples = []
        for r, first in ((r, first) for r in range(B) for first in self._windows(T)):
            end = min(first + self._max_tokens, T)
            answer = (x[r : r + 1, : end if causal else T], y[r : r + 1, first:end])  # (1, T', C), (1, w, C)
            samples.append(sample_of(loaded, answer, first, None, x.shape, backend, request_id, True))
        if (failed := await self._checked(samples, loaded)) is not None:
            raise AnswerRejected(f"{rejected(failed)}: retry, and another backend computes it")

    async def answered_step(
        self, x: np.ndarray, y: np.ndarray, sequence: LiveSequence, backend: str, request_id: str, loaded: Loaded
    ) -> None:
        """As `answered`, for a decode step (B, t, C) that left `sequence` holding its tokens: each
        window of its new tokens with every key and value they attend to."""
        past = sequence.length - x.shape[1]
        held = (c[:, :, : sequence.length].cpu().numpy().copy() for c in (sequence.keys, sequence.values))
        keys, values = held  # (B, nh, P + t, hs)
        samples = []
        for r, first in ((r, first) for r in range(x.shape[0]) for first in self._windows(x.shape[1])):
            end = min(first + self._max_tokens, x.shape[1])
            cache = (keys[r : r + 1, :, : past + end], values[r : r + 1, :, : past + end])  # (1, nh, P + end, hs)
            answer = (x[r : r + 1, :end], y[r : r + 1, first:end])  # (1, end, C), (1, w, C)
            samples.append(sample_of(loaded, answer, first, cache, x.shape, backend, request_id, True))
        if (failed := await self._checked(samples, loaded)) is None:
            return
        loaded.decoder.sequences.drop(distrusted(backend), written_by=backend)  # now, before a retry can step it
        raise SequenceNotFound(
            f"sequence {quote(str(sequence.id), 48)} {distrusted(backend)}: {rejected(failed)}; start it again "
            "with sequence_start and its whole prefix"
        )

    async def _checked(self, samples: list[Sample], loaded: Loaded) -> tuple[Sample, Check] | None:
        """The first sample found wrong, with its verdict; None when every one passed."""
        reference = loaded.reference
        assert reference is not None, "the versions keep a reference where answers are checked"
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._check_all, samples, reference)

    def _check_all(self, samples: list[Sample], reference: Reference) -> tuple[Sample, Check] | None:
        for sample in samples:
            began = self._timer()
            check = reference.check(sample.x, sample.y, sample.cache, sample.first)
            self._on_checked(sample, check, self._timer() - began)
            if not check.passed:
                return sample, check
        return None

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


Audit = Auditor | Gate  # what the door hands each answer to before it goes


def rejected(failed: tuple[Sample, Check]) -> str:
    sample, check = failed
    return (
        f"the answer {sample.backend} computed differs from the float64 reference (relative error "
        f"{check.error:.2e} > {check.allowed:.1e}) and was not sent; {sample.backend} is quarantined"
    )


def distrusted(backend: str) -> str:
    """What became of a sequence dropped because an audit found `backend` computing wrongly."""
    return (
        f"was dropped (an audit found {backend} computing wrongly, and {backend} computed steps of it: its keys "
        "and values are not trusted)"
    )


def mismatch_message(sample: Sample, check: Check) -> str:
    past, (first, last) = sample.past, sample.window
    what = f"shape {sample.shape}" if past is None else f"a decode step of shape {sample.shape} after {past} tokens"
    new = "" if past is None else "new "
    over = f"a row's first {last + 1} {new}tokens" if first == 0 else f"a row's {new}tokens {first} to {last}"
    return (
        f"audit: the answer to request {quote(sample.request_id)} ({what}, version {quote(sample.version)}) from "
        f"{sample.backend} differs from the float64 reference: relative error {check.error:.2e} > "
        f"{check.allowed:.1e} over {over}; {sample.backend} is quarantined until its self-check passes again"
    )
