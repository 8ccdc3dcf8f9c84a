"""What this server serves: the model's identity (known from the settings) and, once loaded,
its shape, tensors and files. Built once; every request and every rendering reads it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from export.layout import INPUT_NAME, OUTPUT_NAME, ModelFiles
from service.errors import ModelNotFound, quote
from service.scheduling import SchedulePolicy

if TYPE_CHECKING:
    import numpy as np

    from model import MHAConfig
    from service.backends.base import Backend
    from service.numerics import MagnitudeBound


@dataclass(frozen=True)
class ModelIdentity:
    """The two model entries this server serves, as Triton lays out one scheduler per model: `name`
    (stateless requests, dynamic batching; it also takes a sequence's steps, for the clients that
    always sent them there) and `sequence_name` (sequence batching: every request a step). Each
    version loaded has its own (`version` set: the version's)."""

    name: str
    version: str
    sequence_name: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, self.sequence_name) if self.sequence_name else (self.name,)

    def check(self, name: str) -> str:
        """A request's model name: the entry it names (its version is the versions' to check)."""
        if name not in self.names:
            served = " and ".join(repr(n) for n in self.names)
            raise ModelNotFound(f"unknown model {quote(name)}; this server serves {served}")
        return name

    def is_sequence_model(self, name: str) -> bool:
        return bool(self.sequence_name) and name == self.sequence_name


@dataclass(frozen=True)
class ServedModel:
    identity: ModelIdentity
    config: MHAConfig
    files: ModelFiles
    max_request_rows: int  # largest B accepted in one request
    max_attention_mb: float  # B x heads x T x T x 4 bytes, per request (and per batch)
    weights_sha256: str  # what is served, as clients and dashboards can compare it
    verified: bool  # manifest.json vouches for both files, the config and the graph
    magnitude: MagnitudeBound | None = None  # the largest |x| that cannot overflow the compute
    precision: str = "fp32"  # the format the served graph computes in (--precision)
    input_name: str = INPUT_NAME
    output_name: str = OUTPUT_NAME

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def version(self) -> str:
        return self.identity.version

    def check_magnitude(self, x: np.ndarray) -> None:
        """Refuse an input whose values could overflow the compute (MagnitudeBound)."""
        if self.magnitude is not None:
            self.magnitude.check(x)

    def attention_mb(self, rows: int, seq: int) -> float:
        """Memory of the attention weights of `rows` sequences of length `seq`: what large requests cost."""
        return rows * self.config.n_head * seq * seq * 4 / 2**20

    @property
    def max_attention_cells(self) -> int:
        """The budget as rows x T x T, the unit the batcher plans in."""
        return int(self.max_attention_mb * 2**20 / (4 * self.config.n_head))

    def labels(self) -> dict[str, str]:
        """The model's description as strings: mha_model_info and ModelConfig parameters."""
        c = self.config
        return {
            "name": self.name,
            "version": self.version,
            "d_model": str(c.d_model),
            "n_head": str(c.n_head),
            "max_seq_len": str(c.max_seq_len),
            "causal": str(c.causal).lower(),
            "weights_sha256": self.weights_sha256,
            "verified": str(self.verified).lower(),
        }


@dataclass(frozen=True)
class Serving:
    """How the model is being served right now."""

    backends: Sequence[Backend]  # the chain, in order
    active: Backend
    selection: str  # why this order: each candidate's verdict
    max_batch_size: int
    max_queue_delay_ms: float
    max_sequences: int = 0  # live sequences kept for incremental decoding; 0: not offered
    sequence_idle_timeout_s: float = 0.0
    schedule: SchedulePolicy = field(default_factory=SchedulePolicy)  # priorities, queue policies
