"""Model configuration."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MHAConfig:
    """Shape of one causal multi-head self-attention block."""

    d_model: int = 128  # C: the seed's embedding width
    n_head: int = 8  # nh: head size hs = C / nh = 16 at the default width
    max_seq_len: int = 1024  # longest T a request may carry; the graph itself does not depend on it
    causal: bool = True  # position t attends only to positions <= t
    bias: bool = True  # nn.Linear(C, C) with bias, as the reference texts write it

    def __post_init__(self) -> None:
        for name in ("d_model", "n_head", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "so every head gets the same width"
            )
        for name in ("causal", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MHAConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> MHAConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"config JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)
