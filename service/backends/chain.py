"""The run-time fallback chain: an error in one backend sends the batch to the next.

Repeated failures quarantine a backend for a cool-down; after it, the backend is probed (self-check)
before it serves again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from service.backends.base import Backend, Step
from service.batching import batch_mflop
from service.errors import BackendFailure, DeviceLost, NotReady
from service.numerics import all_finite

log = logging.getLogger(__name__)

FallbackHook = Callable[[str, str, str], None]  # (from, to, reason)
Now = Callable[[], float]  # time.monotonic, or a test's
T = TypeVar("T")  # what a backend computes: a batch's output, or the outputs of steps
REASONS = ("error", "invalid_output")  # a bounded set: it becomes a metric label
ProbeFn = Callable[[Backend], tuple[bool, str]]

# CUDA errors after which the context is unusable until the process exits (CUDA's "sticky" errors):
# falling back to another backend on the same device would fail too, or worse, answer wrongly.
STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "unspecified launch failure",
    "device-side assert",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ecc",
    "hardware stack error",
    "launch timed out",
)


def is_sticky_device_error(device: str, exc: BaseException) -> bool:
    """An error on a CUDA device that leaves its context broken for the whole process."""
    text = str(exc).lower()
    return device.startswith("cuda") and any(marker in text for marker in STICKY_CUDA_ERRORS)


@dataclass(frozen=True)
class LightRoute:
    """Batches of at most `max_mflop` of work go through `backends`, in this order: the backend
    that computes light shapes fastest is not always the one that computes heavy ones fastest
    (selection.split_by_size)."""

    max_mflop: float
    backends: list[Backend]
    width: int  # the model's C: a batch's work is reckoned from (rows, T, C)

    def takes(self, rows: int, seq: int) -> bool:
        return batch_mflop(rows, seq, self.width) <= self.max_mflop


@dataclass
class _Health:
    consecutive_failures: int = 0
    quarantined_until: float = 0.0  # time.monotonic(); 0 when serving
    found_wrong: int = 0  # audits that found it computing wrongly, this server's workers' (and so on after a restart)
    found_out: bool = False  # its quarantine now is an audit's


MAX_DOUBLINGS = 7  # a backend found wrong again and again sits out at most 2**7 cool-downs at a time


class Quarantine:
    """Which backends sit out a cool-down after repeated failures, and whether one may serve
    again (its probe passes once the cool-down is over). A backend an audit found computing wrongly
    sits out twice as long each time it is found so again: its probe is a fixed input, and a fault
    that shows on some inputs only passes it. `changes` counts quarantines and returns:
    who shows the serving backends looks again when it moves, or while one is quarantined (a
    cool-down ends with the clock, not with a change)."""

    def __init__(self, backends: list[Backend], probe: ProbeFn, threshold: int, cooldown_s: float, clock: Now) -> None:
        self.health = {b.name: _Health() for b in backends}
        self._probe, self._threshold, self._cooldown, self._clock = probe, threshold, cooldown_s, clock
        self.changes = 0
        self._quarantined = 0  # backends quarantined now: read after every batch, so kept, not counted
        self._verdicts: dict[str, tuple[float, bool]] = {}  # backend -> (when, passed): the last blame probe

    def _of(self, backend: Backend) -> _Health:
        """A backend's health; one the chain gained after it was built starts healthy."""
        return self.health.setdefault(backend.name, _Health())

    @property
    def any(self) -> bool:
        return self._quarantined > 0

    def in_service(self, backend: Backend) -> bool:
        return self._of(backend).quarantined_until == 0.0

    def first_healthy(self, order: list[Backend]) -> Backend:
        now = self._clock()
        for backend in order:
            if self._of(backend).quarantined_until <= now:
                return backend
        return order[0]

    def back_in_s(self, backends: list[Backend]) -> float:
        """Seconds until the first of `backends` is checked again (0 if one serves now)."""
        now = self._clock()
        return max(0.0, min(self._of(b).quarantined_until - now for b in backends))

    def quarantined(self, backends: list[Backend]) -> list[str]:
        now = self._clock()
        return [b.name for b in backends if self._of(b).quarantined_until > now]

    def available(self, backend: Backend) -> bool:
        health = self._of(backend)
        if health.quarantined_until == 0.0:
            return True
        if health.quarantined_until > self._clock():
            return False
        ok, why = self._probe(backend)
        self.changes += 1
        if ok:
            log.info("backend %s passed its probe after the cool-down (%s); serving again", backend.name, why)
            health.quarantined_until, health.consecutive_failures, health.found_out = 0.0, 0, False
            self._quarantined -= 1
            return True
        log.warning("backend %s failed its probe after the cool-down (%s); quarantined again", backend.name, why)
        health.quarantined_until = self._clock() + self._cooldown_for(health.found_wrong)
        return False

    def _cooldown_for(self, found_wrong: int) -> float:
        """The cool-down, doubled for each audit that found the backend wrong after the first."""
        return self._cooldown * 2 ** min(max(found_wrong - 1, 0), MAX_DOUBLINGS)

    def failed(self, backend: Backend) -> None:
        health = self._of(backend)
        health.consecutive_failures += 1
        if health.consecutive_failures >= self._threshold and health.quarantined_until == 0.0:
            health.quarantined_until = self._clock() + self._cooldown
            self.changes += 1
            self._quarantined += 1
            log.warning(
                "backend %s quarantined for %.0f s after %d consecutive failures",
                backend.name,
                self._cooldown,
                health.consecutive_failures,
            )

    def succeeded(self, backend: Backend) -> None:
        self._of(backend).consecutive_failures = 0

    def enter(self, name: str) -> int:
        """Quarantine the backend `name` at once (an answer of its was found wrong): batches go to the
        next one, and it serves again only once its probe passes after the cool-down, doubled for
        each time it was found wrong before. Found wrong again while an audit keeps it out (an answer
        it gave before, audited late): nothing more, as it is one incident. Returns how many times it
        has been found wrong, or 0 for that same incident."""
        health = self.health.setdefault(name, _Health())
        if health.found_out:
            return 0
        self._sit_out(name, health, health.found_wrong + 1, self._clock())
        return health.found_wrong

    def join(self, name: str, times: int, ago_s: float) -> bool:
        """Another worker's audit found `name` computing wrongly, its `times`-th time, `ago_s`
        seconds ago: this worker counts as many, and sits out what is left of that incident's
        cool-down (a worker started since may find nothing left). Whether it sits out now."""
        health = self.health.setdefault(name, _Health())
        own, times = health.found_wrong, max(times, health.found_wrong)
        since = self._clock() - max(ago_s, 0.0)
        if since + self._cooldown_for(times) <= self._clock():
            health.found_wrong = times
            return False
        if not health.found_out or times > own:
            self._sit_out(name, health, times, since)
        return True

    def _sit_out(self, name: str, health: _Health, times: int, since: float) -> None:
        if health.quarantined_until == 0.0:
            self._quarantined += 1
        health.found_wrong, health.found_out = times, True
        health.quarantined_until = max(health.quarantined_until, since + self._cooldown_for(times))
        self.changes += 1
        said = "once" if times == 1 else f"{times} times"
        left = health.quarantined_until - self._clock()
        log.warning("backend %s quarantined for %.0f s: found computing wrongly %s", name, left, said)

    def blame_probe(self, backend: Backend) -> bool:
        """The backend's self-check, run at most once per cool-down to judge who is to blame for
        non-finite rows: a client sending such rows cannot make the server check itself at will."""
        now = self._clock()
        when, passed = self._verdicts.get(backend.name, (-float("inf"), False))
        if now - when >= self._cooldown:
            passed = self._probe(backend)[0]
            self._verdicts[backend.name] = (now, passed)
        return passed


class BackendChain:
    def __init__(
        self,
        backends: list[Backend],
        probe: ProbeFn,
        failure_threshold: int = 3,
        cooldown_s: float = 30.0,
        on_fallback: FallbackHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        light: LightRoute | None = None,
        step_backends: list[Backend] | None = None,
    ) -> None:
        if not backends:
            raise ValueError("a backend chain needs at least one backend")
        self.backends = backends
        self.step_backends = step_backends or []  # decode steps' order: every one on the caches' device
        self._light = light
        self._on_fallback = on_fallback
        self.quarantine = Quarantine(backends, probe, failure_threshold, cooldown_s, clock)

    @property
    def active(self) -> Backend:
        """The backend the next heavy batch goes to first (every batch, without a light route)."""
        return self.quarantine.first_healthy(self.backends)

    def orders(self) -> list[list[Backend]]:
        """Every order a batch may try the backends in: the chain's, and the light route's."""
        return [self.backends] if self._light is None else [self.backends, self._light.backends]

    def serving(self) -> list[Backend]:
        """The backend each order tries first now: the active one, and the light route's."""
        return list(dict.fromkeys(self.quarantine.first_healthy(order) for order in self.orders()))

    def quarantined(self) -> list[str]:
        return self.quarantine.quarantined(self.backends)

    def describe(self) -> str:
        """Which backend takes which batches first, as the start-up log says it."""
        light = self._light
        if light is None:
            return self.active.name
        first = self.quarantine.first_healthy(light.backends)
        return f"{first.name} for batches of at most {light.max_mflop:.0f} MFLOP and {self.active.name} above"

    def run(self, x: np.ndarray) -> tuple[np.ndarray, Backend]:
        """Run on the first healthy backend; on error, on the next. Called by one batcher at a time:
        on its worker thread, or on the event loop for a lone small batch (never both at once)."""

        def problem(backend: Backend, y: np.ndarray) -> str:
            if wrong := _output_problem(x, y):
                return wrong
            if not self._finite_or_input_to_blame(backend, x, y):
                return "output holds NaN or inf for a finite input that other backends compute finitely"
            return ""

        order = self.order_for(int(x.shape[0]), int(x.shape[1]))
        return self._first_to_answer(order, lambda b: b.run(x), problem, f"a batch of shape {x.shape}")

    @property
    def steps_device(self) -> str | None:
        """Where the caches of live sequences live: the device of the backends that compute steps."""
        return self.step_backends[0].device if self.step_backends else None

    def run_steps(self, steps: Sequence[Step]) -> tuple[list[np.ndarray], Backend]:
        """Decode steps as `run` takes batches: on the first healthy step backend; on error or an
        invalid output, on the next (each writes the same cache positions again)."""
        if not self.step_backends:
            raise BackendFailure("no backend computes decode steps for this model")
        return self._first_to_answer(
            self.step_backends, lambda b: b.step(steps), lambda _, ys: _steps_problem(steps, ys), f"{len(steps)} steps"
        )

    def _first_to_answer(
        self, order: list[Backend], compute: Callable[[Backend], T], problem: Callable[[Backend, T], str], what: str
    ) -> tuple[T, Backend]:
        """`compute` on the first backend of `order` that is available and answers without a
        `problem`; a failing one is counted towards its quarantine, and the next one tried."""
        errors: list[str] = []
        previous: tuple[Backend, str] | None = None
        for backend in order:
            if not self.quarantine.available(backend):
                continue
            if previous is not None:
                self._fallback(previous[0].name, backend.name, previous[1])
            try:
                out = compute(backend)
            except Exception as exc:  # any backend fault: try the next one, unless the device is gone
                log.error("backend %s failed on %s: %s", backend.name, what, exc, exc_info=True)
                if is_sticky_device_error(backend.device, exc):
                    raise DeviceLost(f"{backend.name} on {backend.device}: {exc}") from exc
                self.quarantine.failed(backend)
                errors.append(f"{backend.name}: {type(exc).__name__}: {exc}")
                previous = (backend, "error")
                continue
            if wrong := problem(backend, out):
                log.error("backend %s returned an invalid output for %s: %s", backend.name, what, wrong)
                self.quarantine.failed(backend)
                errors.append(f"{backend.name}: {wrong}")
                previous = (backend, "invalid_output")
                continue
            self.quarantine.succeeded(backend)
            return out, backend
        if not errors:  # none was tried: the server cannot compute now, and says when it may again
            wait = self.quarantine.back_in_s(order)
            raise NotReady(
                f"every backend is quarantined after failing; the first is checked again in {wait:.0f} s: "
                "retry then, or on another replica"
            )
        raise BackendFailure(f"every backend failed on {what}: {errors}")

    def order_for(self, rows: int, seq: int) -> list[Backend]:
        """The backends a batch of `rows` sequences of `seq` tokens tries, in order."""
        light = self._light
        return light.backends if light is not None and light.takes(rows, seq) else self.backends

    def _finite_or_input_to_blame(self, backend: Backend, x: np.ndarray, y: np.ndarray) -> bool:
        """True when `y` is finite, or its non-finite rows are the input's doing: NaN or inf in
        them, or values so large that attention overflows float32. Then the rows go back as they
        are (the core answers their requests INVALID_ARGUMENT) and nothing counts against the backend.

        The input is to blame when another healthy backend computes the same rows non-finite
        too or, with no other backend to ask, when this backend still passes its self-check.
        """
        if all_finite(y):
            return True
        bad = ~np.isfinite(y).reshape(y.shape[0], -1).all(axis=1)  # (B,) rows with NaN or inf
        rows = x[bad]  # (b, T, C)
        if not all_finite(rows):  # NaN or inf sent by the client: nothing to ask another backend
            return True
        for other in self.backends:
            if other is backend or not self.quarantine.in_service(other):
                continue
            try:
                return not bool(np.isfinite(other.run(rows)).all())
            except Exception:  # a failing witness says nothing: ask the next
                continue
        return self.quarantine.blame_probe(backend)

    def _fallback(self, source: str, target: str, reason: str) -> None:
        log.warning("falling back from %s to %s (%s)", source, target, reason)
        if self._on_fallback is not None:
            self._on_fallback(source, target, reason)


def _output_problem(x: np.ndarray, y: np.ndarray) -> str:
    return f"output shape {y.shape} for input {x.shape}" if y.shape != x.shape else ""


def _steps_problem(steps: Sequence[Step], ys: list[np.ndarray]) -> str:
    """What is wrong with a backend's outputs of `steps`: a shape, or NaN or inf out of a finite
    input (a step with NaN or inf in its input answers them: its commit refuses it, by name)."""
    if len(ys) != len(steps):
        return f"{len(ys)} outputs for {len(steps)} steps"
    for step, y in zip(steps, ys, strict=True):
        if y.shape != step.x.shape:
            return f"output shape {y.shape} for a step of {step.x.shape}"
        if not all_finite(y) and all_finite(step.x):
            return "output holds NaN or inf for a finite input"
    return ""
