"""What every backend provides: a stateless forward pass, and the decode step of live sequences."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch


class BackendLoadError(RuntimeError):
    """A backend could not be created on this machine; the message says why."""


class KVCache(Protocol):
    """The keys and values a live sequence holds, as a backend reads and writes them."""

    @property
    def keys(self) -> torch.Tensor: ...  # (B, nh, capacity, hs) float32, on the backend's device

    @property
    def values(self) -> torch.Tensor: ...  # (B, nh, capacity, hs)

    @property
    def length(self) -> int: ...  # tokens held: positions [0, length) of keys and values


K = TypeVar("K", bound=KVCache)  # the cache's type: the decoding layer's live sequence, a probe's


@dataclass(frozen=True)
class Step(Generic[K]):
    """A decode step: the new tokens of one sequence, and its cache."""

    cache: K
    x: np.ndarray  # (B, t, C) float32: the new tokens of each of the sequence's B rows


class Backend(ABC):
    """Runs (B, T, C) float32 -> (B, T, C) float32, and decode steps when it has a step graph or
    module (`steps`). One call at a time (the batchers see to it)."""

    name: str  # "ort-cuda", "ort-cpu", "torch-cuda", "torch-cpu"
    device: str  # "cuda:0", "cpu": where it computes, and where the caches of its steps must live
    platform: str  # Triton's platform name for ModelMetadata
    single_max_tokens = 0  # a CPU backend's: rows x T up to which a batch runs on one thread

    @abstractmethod
    def run(self, x: np.ndarray) -> np.ndarray:
        """(B, T, C) float32 -> (B, T, C) float32."""

    @property
    def steps(self) -> bool:
        """Whether it computes decode steps."""
        return False

    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        """The outputs (B, t, C) of each step, in order; the new tokens' keys and values written
        into each cache at [length, length + t). Nothing else changes: the caller commits the
        length once the answer is delivered, so a step that fails or is abandoned leaves its
        sequence as it was (a retry writes the same positions again)."""
        raise NotImplementedError(f"{self.name} computes no decode steps")

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the backend holds."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
