"""Checkpoints: safetensors with the four projections and the config in the metadata.

Also imports GPT-2 / nanoGPT checkpoints whose q, k, v are one fused `c_attn` projection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.config import MHAConfig
from model.reference import PROJECTIONS

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]
CONFIG_KEY = "mha_config"
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the reason."""


def expected_shapes(config: MHAConfig) -> dict[str, tuple[int, ...]]:
    C = config.d_model
    shapes: dict[str, tuple[int, ...]] = {}
    for name in PROJECTIONS:
        shapes[f"{name}.weight"] = (C, C)
        if config.bias:
            shapes[f"{name}.bias"] = (C,)
    return shapes


def init_weights(config: MHAConfig, seed: int = 0) -> Weights:
    """Seeded weights drawn as nn.Linear draws them: U(-1/sqrt(C), 1/sqrt(C))."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(config.d_model)
    return {
        key: (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        for key, shape in expected_shapes(config).items()
    }


def validate_weights(weights: Mapping[str, torch.Tensor], config: MHAConfig) -> None:
    """Raise CheckpointError naming every key, shape, dtype or value that is wrong."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if extra:
            parts.append(f"unexpected keys {extra}")
        raise CheckpointError(f"{'; '.join(parts)}; expected exactly {sorted(expected)} for bias={config.bias}")
    for key, shape in expected.items():
        tensor = weights[key]
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{key} has dtype {tensor.dtype}; expected a floating dtype ({', '.join(str(d) for d in FLOAT_DTYPES)})"
            )
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{key} has shape {tuple(tensor.shape)}; expected {shape} for d_model={config.d_model}"
            )
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{key} holds {bad} non-finite values (NaN or inf)")


def save_checkpoint(path: str | Path, weights: Mapping[str, torch.Tensor], config: MHAConfig) -> None:
    validate_weights(weights, config)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in weights.items()}
    try:
        save_file(tensors, str(path), metadata={CONFIG_KEY: config.to_json()})
    except SafetensorError as exc:  # its writer's I/O errors (a full disk) come as its own type
        raise OSError(f"{path}: {exc}") from exc


def load_checkpoint(path: str | Path) -> tuple[MHAConfig, Weights]:
    """Load one of our checkpoints; the config comes from its metadata."""
    tensors, metadata = _read_safetensors(path)
    if CONFIG_KEY not in metadata:
        raise CheckpointError(
            f"{path}: no '{CONFIG_KEY}' metadata; expected the model config as JSON (keys found: {sorted(tensors)[:8]})"
        )
    try:
        config = MHAConfig.from_json(metadata[CONFIG_KEY])
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: invalid '{CONFIG_KEY}' metadata: {exc}") from exc
    _check_config_matches(tensors, config, path)
    validate_weights(tensors, config)
    return config, tensors


def stored_config(path: str | Path) -> MHAConfig | None:
    """The config one of our checkpoints says it holds, read from its header alone (no tensor is
    loaded); None when the file is not one (load_checkpoint says why)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return MHAConfig.from_json((f.metadata() or {})[CONFIG_KEY])
    except (SafetensorError, OSError, RuntimeError, KeyError, ValueError, TypeError):
        return None


def _check_is_file(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")


def _read_safetensors(path: str | Path) -> tuple[Weights, dict[str, str]]:
    path = Path(path)
    _check_is_file(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc
    return tensors, metadata


def _check_config_matches(tensors: Mapping[str, torch.Tensor], config: MHAConfig, path: str | Path) -> None:
    w = tensors.get("q_proj.weight")
    if w is not None and w.ndim == 2 and w.shape[0] != config.d_model:
        raise CheckpointError(
            f"{path}: config says d_model={config.d_model} but q_proj.weight has shape "
            f"{tuple(w.shape)}; the config and the tensors disagree"
        )
    has_bias = "q_proj.bias" in tensors
    if has_bias != config.bias:
        raise CheckpointError(
            f"{path}: config says bias={config.bias} but the checkpoint "
            f"{'has' if has_bias else 'lacks'} bias tensors; the config and the tensors disagree"
        )


def import_fused(
    state: Mapping[str, torch.Tensor], n_head: int, max_seq_len: int = 1024, prefix: str | None = None
) -> tuple[MHAConfig, Weights]:
    """Split a fused `c_attn` (q, k, v) plus `c_proj` into our four projections.

    GPT-2 stores Conv1D weights as (C, 3C) (y = x @ W); nanoGPT stores nn.Linear weights as
    (3C, C) (y = x @ W.T). The layout is told apart by shape.
    """
    prefix = _find_prefix(state) if prefix is None else prefix
    if f"{prefix}c_attn.weight" not in state:
        layers = sorted(k.removesuffix("c_attn.weight") for k in state if k.endswith("c_attn.weight"))
        shown = ", ".join(repr(p) for p in layers[:8]) + (", ..." if len(layers) > 8 else "")
        raise CheckpointError(f"no layer {prefix!r} in this file (no {prefix}c_attn.weight); its layers: {shown}")
    w_attn = state[f"{prefix}c_attn.weight"]
    w_proj = state.get(f"{prefix}c_proj.weight")
    if w_proj is None:
        raise CheckpointError(f"found {prefix}c_attn.weight but no {prefix}c_proj.weight")
    if w_attn.ndim != 2 or 3 * min(w_attn.shape) != max(w_attn.shape):
        raise CheckpointError(
            f"{prefix}c_attn.weight has shape {tuple(w_attn.shape)}; expected (C, 3C) (GPT-2 "
            "Conv1D) or (3C, C) (nanoGPT Linear)"
        )
    conv1d = w_attn.shape[1] == 3 * w_attn.shape[0]
    C = min(w_attn.shape)
    if conv1d:
        w_attn, w_proj = w_attn.T, w_proj.T  # to nn.Linear's (out, in)
    b_attn = state.get(f"{prefix}c_attn.bias")
    b_proj = state.get(f"{prefix}c_proj.bias")
    config = MHAConfig(d_model=C, n_head=n_head, max_seq_len=max_seq_len, bias=b_attn is not None)
    weights: Weights = {}
    for i, name in enumerate(PROJECTIONS[:3]):
        weights[f"{name}.weight"] = w_attn[i * C : (i + 1) * C].contiguous()  # (C, C)
        if b_attn is not None:
            weights[f"{name}.bias"] = b_attn[i * C : (i + 1) * C].contiguous()  # (C,)
    weights["o_proj.weight"] = w_proj.contiguous()
    if b_proj is not None:
        weights["o_proj.bias"] = b_proj.contiguous()
    log.info(
        "imported %s layout c_attn from prefix %r: C=%d", "GPT-2 Conv1D" if conv1d else "nanoGPT Linear", prefix, C
    )
    validate_weights(weights, config)
    return config, weights


def _find_prefix(state: Mapping[str, torch.Tensor]) -> str:
    prefixes = sorted(k[: -len("c_attn.weight")] for k in state if k.endswith("c_attn.weight"))
    if not prefixes:
        raise CheckpointError(f"no '*c_attn.weight' key to import; keys found: {sorted(state)[:10]}")
    if len(prefixes) > 1:
        raise CheckpointError(
            f"{len(prefixes)} attention layers found ({prefixes[:4]}...); choose one with "
            "--import-prefix, e.g. 'h.0.attn.'"
        )
    return prefixes[0]


def load_any(
    path: str | Path, n_head: int | None = None, max_seq_len: int | None = None, prefix: str | None = None
) -> tuple[MHAConfig, Weights]:
    """Our safetensors, a GPT-2 safetensors, or a nanoGPT `.pt` (loaded with weights_only=True)."""
    path = Path(path)
    if path.suffix in (".pt", ".pth", ".bin"):
        state, args = _read_torch(path)
    else:
        state, metadata = _read_safetensors(path)
        if CONFIG_KEY in metadata:
            return _ours(path, n_head, max_seq_len)
        args = {}
    if not any(k.endswith("c_attn.weight") for k in state):
        raise CheckpointError(
            f"{path}: neither our checkpoint (no '{CONFIG_KEY}' metadata) nor a fused c_attn "
            f"checkpoint; keys found: {sorted(state)[:10]}"
        )
    heads = n_head if n_head is not None else args.get("n_head")
    if heads is None:
        raise CheckpointError(f"{path}: the checkpoint does not say how many heads it has; pass --n-head")
    seq = max_seq_len if max_seq_len is not None else args.get("block_size", 1024)
    try:
        return import_fused(state, n_head=int(heads), max_seq_len=int(seq), prefix=prefix)
    except ValueError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: {exc}") from exc


def _ours(path: Path, n_head: int | None, max_seq_len: int | None) -> tuple[MHAConfig, Weights]:
    """Our checkpoint: its config says the heads, which the weights' function depends on; the
    longest T served is a limit, not part of the function, so a given one replaces the stored."""
    config, weights = load_checkpoint(path)
    if n_head is not None and n_head != config.n_head:
        raise CheckpointError(
            f"{path} holds a model of {config.n_head} heads; {n_head} heads would compute another function: "
            "drop --n-head"
        )
    if max_seq_len is not None:
        config = replace(config, max_seq_len=max_seq_len)
    return config, weights


def _read_torch(path: Path) -> tuple[Weights, dict[str, int]]:
    _check_is_file(path)
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for bad or unsafe pickles
        said = str(exc).strip()[:300] or type(exc).__name__
        raise CheckpointError(
            f"{path}: not a PyTorch checkpoint that loads with weights_only=True ({type(exc).__name__}: {said})"
        ) from exc
    args: dict[str, int] = {}
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        args = {k: v for k, v in dict(obj.get("model_args") or {}).items() if isinstance(v, int)}
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a state dict, got {type(obj).__name__}")
    state = {k.removeprefix("_orig_mod."): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    return state, args
