"""The causal multi-head self-attention model: config, module, float64 references, checkpoints."""

from model.attention import MultiHeadAttention
from model.config import MHAConfig

__all__ = ["MHAConfig", "MultiHeadAttention"]
