"""The parity grid `mha export` and `mha verify` check a model on, and the memory that takes.

Light on purpose (no torch, no onnx): the CLI refuses a model too large to check before it loads them.
"""

from __future__ import annotations

from model.config import MHAConfig


def _largest_prime_at_most(n: int) -> int:
    for p in range(n, 1, -1):
        if all(p % d for d in range(2, int(p**0.5) + 1)):
            return p
    return 2


def parity_grid(max_seq_len: int) -> list[tuple[int, int]]:
    """(B, T) pairs: T = 1, primes, a power of two, max_seq_len; every B from 1 to 8."""
    mid_prime = _largest_prime_at_most(max(2, max_seq_len // 2))
    pairs = [(1, 1), (8, 1), (2, 2), (3, 13), (4, 61), (5, 64), (6, mid_prime), (7, max_seq_len), (1, max_seq_len)]
    seen: list[tuple[int, int]] = []
    for b, t in pairs:
        t = min(t, max_seq_len)
        if (b, t) not in seen:
            seen.append((b, t))
    return seen


BYTES_PER_SCORE = 28  # measured peak of `mha export` at T 1024-3072: about 21 bytes per score, and margin
WEIGHT_COPIES = 8  # the weights in float32 and float64, in torch, the ONNX proto and an ORT session
BASE_BYTES = 768 << 20  # torch, onnx and ORT loaded (0.5-0.7 GB seen)


def parity_peak_bytes(config: MHAConfig) -> int:
    """About the most memory exporting and checking `config` takes: its largest parity case holds
    B x n_head x T x T attention scores in float64 in each reference, and float32 in ORT
    (docs/model-and-export.md); 25-40 % above the peaks measured, which vary by machine."""
    grid = parity_grid(config.max_seq_len)
    scores = max(b * config.n_head * t * t for b, t in grid)
    activations = max(b * t for b, t in grid) * config.d_model * 8 * 8  # x, q, k, v, y, in float64
    weights = 4 * (config.d_model + 1) * config.d_model * 4
    return BASE_BYTES + scores * BYTES_PER_SCORE + activations + weights * WEIGHT_COPIES
