"""Live sequences for incremental decoding: each one's keys and values, kept between steps.

A client sends a sequence's tokens a few at a time (Triton's sequence parameters); the server
keeps the keys and values of every token so far and computes only the new ones. This module
holds that state and its limits; the backends compute steps (`Backend.step`) and
`StepBatcher` (service/decode/scheduler.py) batches the steps of different sequences.

Everything here runs on the event loop's thread. A sequence's steps run one at a time, in
arrival order (a FIFO lock per sequence); eviction never touches a sequence that is stepping
or has a step waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from model import MHAConfig
from service.decode.control import SequenceControl, SequenceId
from service.errors import InvalidInput, Overloaded, SequenceNotFound, quote

log = logging.getLogger(__name__)

FORGOTTEN_IDS = 4096  # how many ended or evicted ids are remembered, to say what became of them


@dataclass(frozen=True)
class SequenceLimits:
    max_sequences: int = 256
    idle_timeout_s: float = 60.0
    max_state_bytes: int = 1 << 30


@dataclass(eq=False)
class LiveSequence:
    """One live sequence: `rows` sequences of the client's batch, stepped together.

    keys and values are (rows, nh, capacity, hs); the first `length` positions are the tokens
    so far. Capacity grows by doubling (up to max_seq_len), so a step copies nothing old.
    """

    id: SequenceId
    rows: int
    keys: torch.Tensor
    values: torch.Tensor
    last_used: float
    length: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    live: bool = True  # False once ended, evicted or replaced by a restart
    writers: set[str] = field(default_factory=set)  # the backends that computed its steps (the compute thread's)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    def busy(self) -> bool:
        return self.lock.locked()


def _cache(rows: int, config: MHAConfig, capacity: int, device: str) -> torch.Tensor:
    return torch.zeros(rows, config.n_head, capacity, config.head_size, device=device)  # (B, nh, capacity, hs)


class Home(NamedTuple):
    """Where a store's sequences live."""

    device: str  # where the caches live: the step backends' device
    label: str  # this process, as messages name it for operators (replica and worker)


class SequenceStore:
    """The live sequences of this process, within their count, idle time and byte budget."""

    def __init__(
        self,
        config: MHAConfig,
        limits: SequenceLimits,
        now: Callable[[], float],
        on_change: Callable[[SequenceStore, str | None, SequenceId | None], None] | None = None,
        device: str = "cpu",
        process_label: str = "this server",
    ) -> None:
        self.config, self.limits, self.now = config, limits, now
        self.home = Home(device, process_label)
        self._live: OrderedDict[SequenceId, LiveSequence] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[SequenceId, str] = OrderedDict()  # id -> what became of it
        self._on_change = on_change or (lambda *_: None)  # (store, eviction reason or None, a gone id or None)
        self.state_bytes = 0

    def __len__(self) -> int:
        return len(self._live)

    def holds(self, sequence_id: SequenceId) -> bool:
        """Is this sequence live here (its keys and values kept)?"""
        return sequence_id in self._live

    def open(self, control: SequenceControl, rows: int, width: int) -> LiveSequence:
        """The sequence a step belongs to: a new one on start, else the live one with its checks."""
        if not self.config.causal:
            raise InvalidInput("this model is not causal: it cannot be decoded incrementally; send whole sequences")
        if width != self.config.d_model:
            raise InvalidInput(f"C = {width}; expected C = {self.config.d_model}")
        self.expire_idle()
        if control.start:
            return self._begin(control.id, rows)
        sequence = self._live.get(control.id)
        if sequence is None:
            what = self._gone.get(control.id, "is not known")
            raise SequenceNotFound(
                f"sequence {control.label()} {what} on {self.home.label}; start it again with sequence_start "
                "and its whole prefix"
            )
        if rows != sequence.rows:
            raise InvalidInput(f"sequence {control.label()} has B = {sequence.rows} rows; this step sends B = {rows}")
        self._live.move_to_end(control.id)
        return sequence

    def check_room(self, sequence: LiveSequence, new_tokens: int) -> None:
        """Refuse a step that would grow `sequence` past max_seq_len; grow its cache if needed,
        evicting idle sequences (least recently used first) when the byte budget requires."""
        if not sequence.live:
            raise SequenceNotFound(
                f"sequence {quote(str(sequence.id), 48)} {self._gone.get(sequence.id, 'ended')} on "
                f"{self.home.label} while this step waited; start it again with sequence_start and its whole prefix"
            )
        need = sequence.length + new_tokens
        if need > self.config.max_seq_len:
            raise InvalidInput(
                f"sequence {quote(str(sequence.id), 48)} holds {sequence.length} tokens; {new_tokens} more exceed "
                f"max_seq_len {self.config.max_seq_len}: end it, or start a new one"
            )
        if need > sequence.capacity:
            self._grow(sequence, need)

    def touch(self, sequence: LiveSequence) -> None:
        sequence.last_used = self.now()

    def end(self, sequence: LiveSequence, why: str = "ended (sequence_end)") -> None:
        """Drop `sequence` if it is still live: its client ended it, or `why` (its keys and values are not trusted)."""
        if sequence.live:
            self._drop(sequence, why, None)

    def expire_idle(self) -> None:
        """Evict every sequence idle longer than the timeout (not those stepping or waiting)."""
        deadline = self.now() - self.limits.idle_timeout_s
        for sequence in [s for s in self._live.values() if s.last_used < deadline and not s.busy()]:
            self._drop(sequence, f"was evicted after {self.limits.idle_timeout_s:g} s idle", "idle")

    def drop(self, why: str, written_by: str | None = None) -> int:
        """Drop every live sequence (at shutdown), or each one whose steps `written_by` computed; how many."""
        doomed = [s for s in self._live.values() if written_by is None or written_by in s.writers]
        for sequence in doomed:
            self._drop(sequence, why, None)
        return len(doomed)

    def _begin(self, sequence_id: SequenceId, rows: int) -> LiveSequence:
        old = self._live.get(sequence_id)
        if old is not None:  # the id stays live here: not reported gone
            self._drop(old, "was restarted (sequence_start)", None, restarted=True)
        capacity = min(16, self.config.max_seq_len)
        self._evict_for(count=1, nbytes=self._cache_bytes(rows, capacity))
        keys, values = (_cache(rows, self.config, capacity, self.home.device) for _ in range(2))  # (B, nh, cap, hs)
        sequence = LiveSequence(sequence_id, rows, keys, values, last_used=self.now())
        self._live[sequence_id] = sequence
        self._gone.pop(sequence_id, None)
        self.state_bytes += sequence.nbytes
        self._on_change(self, None, None)
        return sequence

    def _grow(self, sequence: LiveSequence, need: int) -> None:
        capacity = sequence.capacity
        while capacity < need:
            capacity = min(2 * capacity, self.config.max_seq_len)
        extra = self._cache_bytes(sequence.rows, capacity - sequence.capacity)
        self._evict_for(count=0, nbytes=extra, keep=sequence)
        for name in ("keys", "values"):
            new = _cache(sequence.rows, self.config, capacity, self.home.device)  # (B, nh, capacity, hs)
            new[:, :, : sequence.length] = getattr(sequence, name)[:, :, : sequence.length]
            setattr(sequence, name, new)
        self.state_bytes += extra
        self._on_change(self, None, None)

    def _cache_bytes(self, rows: int, positions: int) -> int:
        """Keys and values of `positions` tokens of `rows` rows, float32."""
        return 2 * rows * self.config.d_model * positions * 4

    def _evict_for(self, count: int, nbytes: int, keep: LiveSequence | None = None) -> None:
        """Make room for `count` more sequences and `nbytes` more state by evicting idle ones,
        least recently used first; RESOURCE_EXHAUSTED when the busy ones alone are too many."""

        def short() -> bool:
            over_count = len(self._live) + count > self.limits.max_sequences
            return over_count or self.state_bytes + nbytes > self.limits.max_state_bytes

        for sequence in list(self._live.values()):
            if not short():
                return
            if sequence is not keep and not sequence.busy():
                self._drop(sequence, "was evicted to make room for other sequences (state budget)", "budget")
        if short():
            raise Overloaded(
                f"the sequence state is full ({len(self._live)} live sequences, {self.state_bytes / 2**20:.1f} MiB of "
                f"{self.limits.max_state_bytes / 2**20:.0f} MiB, at most {self.limits.max_sequences} sequences) and "
                "every sequence is stepping; retry with backoff"
            )

    def _drop(self, sequence: LiveSequence, what: str, reason: str | None, restarted: bool = False) -> None:
        if self._live.get(sequence.id) is sequence:
            del self._live[sequence.id]
            self.state_bytes -= sequence.nbytes
        sequence.live = False
        self._gone[sequence.id] = what
        while len(self._gone) > FORGOTTEN_IDS:
            self._gone.popitem(last=False)
        if reason is not None:
            log.info("sequence %s %s", quote(str(sequence.id), 48), what)
        self._on_change(self, reason, None if restarted else sequence.id)
