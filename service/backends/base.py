"""What every backend provides."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class BackendLoadError(RuntimeError):
    """A backend could not be created on this machine; the message says why."""


class Backend(ABC):
    """Runs (B, T, C) float32 -> (B, T, C) float32. One call at a time (the batcher sees to it)."""

    name: str  # "ort-cuda", "ort-cpu", "torch-cuda", "torch-cpu"
    device: str  # "cuda:0", "cpu"
    platform: str  # Triton's platform name for ModelMetadata

    @abstractmethod
    def run(self, x: np.ndarray) -> np.ndarray:
        """(B, T, C) float32 -> (B, T, C) float32."""

    def run_alone(self, x: np.ndarray) -> np.ndarray:
        """A small request of a lone client (nothing else in the server, and no batch shared of
        late): as `run`, unless a backend has a faster way for it (ORT-CPU: a pool that spins)."""
        return self.run(x)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the backend holds."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
