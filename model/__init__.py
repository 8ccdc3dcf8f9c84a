"""The causal multi-head self-attention model: config, module, float64 references, checkpoints.

The config needs no PyTorch, and importing the package loads none: `mha serve` sets PyTorch's
OpenMP wait policy from its flags before anything loads PyTorch (its runtime reads it once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model.config import MHAConfig

if TYPE_CHECKING:
    from model.attention import MultiHeadAttention

__all__ = ["MHAConfig", "MultiHeadAttention"]


def __getattr__(name: str) -> Any:
    if name == "MultiHeadAttention":
        from model.attention import MultiHeadAttention

        return MultiHeadAttention
    raise AttributeError(f"module 'model' has no attribute {name!r}")
