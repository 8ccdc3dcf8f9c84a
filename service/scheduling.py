"""Triton's schedule policy for the stateless model's queue, as its config has it (ModelDynamicBatching):
priority levels (1 the highest) and, per level, a queue policy: how long a request may wait, what
happens when that time passes (REJECT: DEADLINE_EXCEEDED at once; DELAY: it goes behind every
request of its level still within its time), whether a request's own `timeout` may shorten the
wait, and how many of the level's requests may wait.

One departure, to bound starvation: a request overtaken by `max_overtakes` batches formed after
it arrived goes first (0: never, Triton's strict priority).

Pure: no event loop, no clock, no gRPC.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from service.errors import InvalidInput, Overloaded

REJECT, DELAY = "REJECT", "DELAY"
TIMEOUT_ACTIONS = (REJECT, DELAY)


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy, with its field names."""

    timeout_action: str = REJECT
    default_timeout_microseconds: int = 0  # 0: no timeout of the level's own
    allow_timeout_override: bool = True  # a request's `timeout` may set a shorter one (or one, where none)
    max_queue_size: int = 0  # requests of the level waiting at most; 0: only --max-queue-size bounds them

    def __post_init__(self) -> None:
        if self.timeout_action not in TIMEOUT_ACTIONS:
            raise ValueError(f"timeout_action {self.timeout_action!r}: expected REJECT or DELAY")
        if self.default_timeout_microseconds < 0 or self.max_queue_size < 0:
            raise ValueError("default_timeout_microseconds and max_queue_size must be >= 0")

    def timeout_s(self, requested_s: float | None) -> float | None:
        """How long a request may wait in the queue: the level's timeout, or the request's own where
        the policy lets it override and it is shorter (Triton's rule; where the level has none, the
        request's stands). None: no limit."""
        default = self.default_timeout_microseconds / 1e6 if self.default_timeout_microseconds else None
        if requested_s is None or not self.allow_timeout_override:
            return default
        return requested_s if default is None else min(default, requested_s)

    @property
    def delays(self) -> bool:
        return self.timeout_action == DELAY


@dataclass(frozen=True)
class SchedulePolicy:
    """Priority levels and their queue policies (Triton's dynamic_batching fields)."""

    priority_levels: int = 1
    default_priority_level: int = 1
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: Mapping[int, QueuePolicy] = field(default_factory=dict)
    max_overtakes: int = 16  # batches that may overtake a waiting request before it goes first; 0: no bound

    def __post_init__(self) -> None:
        if self.priority_levels < 1:
            raise ValueError(f"priority_levels must be >= 1, got {self.priority_levels}")
        if not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(
                f"default_priority_level {self.default_priority_level} is outside the levels 1..{self.priority_levels}"
            )
        if unknown := sorted(level for level in self.priority_queue_policy if not 1 <= level <= self.priority_levels):
            raise ValueError(f"queue policy for level {unknown[0]}: the levels are 1..{self.priority_levels}")

    def level(self, requested: int) -> int:
        """A request's `priority` (0: the default level) as its level; refused outside the levels."""
        if requested == 0:
            return self.default_priority_level
        if not 1 <= requested <= self.priority_levels:
            levels = "1" if self.priority_levels == 1 else f"1..{self.priority_levels}"
            raise InvalidInput(
                f"priority {requested}: this model has priority levels {levels} (1 the highest); "
                "send one of them, or 0 for the default level"
            )
        return requested

    def policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)

    @property
    def reorders(self) -> bool:
        """Can the queue's order differ from arrival order? (Otherwise the engine skips ranking.)"""
        policies = [self.default_queue_policy, *self.priority_queue_policy.values()]
        return self.priority_levels > 1 or any(p.delays for p in policies)


class Ranked(Protocol):
    level: int
    arrival: int
    timeout_at: float | None
    delays: bool
    delayed: bool
    overtaken: int

    @property
    def gone(self) -> bool: ...


def rank(item: Ranked, max_overtakes: int) -> tuple[int, bool, int]:
    """Sort key of a queued request: starved first, then its level, within time before delayed,
    then arrival."""
    starved = max_overtakes > 0 and item.overtaken >= max_overtakes
    return (0 if starved else item.level, item.delayed, item.arrival)


def note_overtaken(batch: list[Ranked], rest: list[Ranked]) -> None:
    """Each request left waiting that arrived before one of the batch was overtaken once more."""
    if not batch or not rest:
        return
    newest = max(item.arrival for item in batch)
    for item in rest:
        if item.arrival < newest:
            item.overtaken += 1


W = TypeVar("W", bound=Ranked)


class WaitQueue(Generic[W]):
    """The requests waiting for a batch, under a SchedulePolicy: admitted (their level, their
    timeout, their level's bound), timed out (REJECT: handed back to be refused; DELAY: moved
    behind their level), and shown to the planner in the order they are to be served."""

    def __init__(self, schedule: SchedulePolicy, max_queue_size: int) -> None:
        self.schedule, self.max_queue_size = schedule, max_queue_size  # the latter: every level's together
        self.items: list[W] = []  # arrival order unless the policy reorders
        self.next_timeout = math.inf  # the earliest timeout_at of a waiting request
        self._reorders = schedule.reorders
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.items)

    def admit(self, item: W, priority: int, timeout_s: float | None, now: float) -> bool:
        """Queue `item` at its level; True when its timeout is now the earliest to watch.
        InvalidInput for a priority outside the levels, Overloaded when its level is full."""
        if len(self.items) >= self.max_queue_size:
            raise Overloaded(
                f"queue full: {len(self.items)} requests waiting (max_queue_size {self.max_queue_size}); "
                "retry with backoff"
            )
        item.level = level = self.schedule.level(priority)
        policy = self.schedule.policy(level)
        if policy.max_queue_size and sum(1 for q in self.items if q.level == level) >= policy.max_queue_size:
            raise Overloaded(
                f"queue full at priority level {level}: {policy.max_queue_size} requests waiting "
                "(its max_queue_size); retry with backoff"
            )
        item.arrival = next(self._arrivals)
        self.items.append(item)
        wait = policy.timeout_s(timeout_s)
        if wait is None:
            return False
        item.timeout_at, item.delays = now + wait, policy.delays
        if item.timeout_at < self.next_timeout:
            self.next_timeout = item.timeout_at
            return True
        return False

    def time_out(self, now: float) -> list[W]:
        """Apply the timeouts that passed by `now`: DELAYed requests stay, behind their level;
        REJECTed ones leave the queue and are returned, for the caller to refuse."""
        if self.next_timeout > now:
            return []
        rejected, kept, soonest = list[W](), list[W](), math.inf
        for item in self.items:
            at = item.timeout_at
            if at is not None and at <= now and not item.gone:
                if not item.delays:
                    rejected.append(item)
                    continue
                item.delayed, item.timeout_at = True, None
            elif at is not None:
                soonest = min(soonest, at)
            kept.append(item)
        self.items, self.next_timeout = kept, soonest
        return rejected

    def in_order(self) -> list[W]:
        """The waiting requests in the order they are to be served."""
        if not self._reorders:
            return self.items
        bound = self.schedule.max_overtakes
        return sorted(self.items, key=lambda item: rank(item, bound))

    def leave(self, batch: list[W], rest: list[W]) -> None:
        """The planner took `batch`; `rest` waits on (the planner dropped the dead)."""
        if self._reorders:
            note_overtaken(batch, rest)  # type: ignore[arg-type]
        self.items = rest


# Parsing the --queue-policy flag: "[LEVEL:]key=value,key=value;..." ------------------------------------


def parse_queue_policies(text: str) -> tuple[QueuePolicy, dict[int, QueuePolicy]]:
    """`timeout_action=DELAY,default_timeout_microseconds=5000;2:max_queue_size=16` -> the default
    policy and the policies of levels; ValueError naming the part that is wrong."""
    default, levels = QueuePolicy(), dict[int, QueuePolicy]()
    for entry in (part.strip() for part in text.split(";")):
        if not entry:
            continue
        level_text, _, body = entry.rpartition(":")
        if level_text and not _count(level_text.strip()):
            raise ValueError(f"queue policy {entry[:80]!r}: expected [LEVEL:]key=value,... with LEVEL a number")
        policy = _policy(body, entry)
        if level_text:
            levels[int(level_text)] = policy
        else:
            default = policy
    return default, levels


_FIELDS = {
    "timeout_action": str,
    "default_timeout_microseconds": int,
    "allow_timeout_override": bool,
    "max_queue_size": int,
}


def _policy(body: str, entry: str) -> QueuePolicy:
    policy = QueuePolicy()
    for pair in (p.strip() for p in body.split(",")):
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _FIELDS:
            raise ValueError(f"queue policy {entry[:80]!r}: {pair[:40]!r} is not one of {', '.join(_FIELDS)}=VALUE")
        policy = replace(policy, **{key: _value(_FIELDS[key], value, entry)})
    return policy


def _count(text: str) -> bool:
    return text.isascii() and text.isdigit()  # int() fails on '²', which isdigit() takes


def _value(kind: type, value: str, entry: str) -> Any:
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise ValueError(f"queue policy {entry[:80]!r}: expected true or false, got {value[:20]!r}")
        return value.lower() == "true"
    if kind is int:
        if not _count(value):
            raise ValueError(f"queue policy {entry[:80]!r}: expected a count, got {value[:20]!r}")
        return int(value)
    return value.upper()
