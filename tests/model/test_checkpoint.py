"""Checkpoints: round trip, every bad case with its own message, fused c_attn imports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model import MHAConfig
from model.checkpoint import CheckpointError, init_weights, load_any, load_checkpoint, save_checkpoint
from model.reference import attention_view, relative_error

CONFIG = MHAConfig(d_model=16, n_head=4, max_seq_len=32)


def test_round_trip(tmp_path: Path) -> None:
    weights = init_weights(CONFIG, seed=5)
    save_checkpoint(tmp_path / "w.safetensors", weights, CONFIG)
    config, loaded = load_checkpoint(tmp_path / "w.safetensors")
    assert config == CONFIG
    assert all(torch.equal(weights[k], loaded[k]) for k in weights)


def test_seed_is_deterministic_and_matters() -> None:
    a, b, c = init_weights(CONFIG, 1), init_weights(CONFIG, 1), init_weights(CONFIG, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["q_proj.weight"], c["q_proj.weight"])


def _write(path: Path, tensors: dict[str, torch.Tensor], config_json: str | None) -> Path:
    save_file(tensors, str(path), metadata={"mha_config": config_json} if config_json is not None else None)
    return path


def _bad_cases() -> list[tuple[str, dict[str, torch.Tensor], str | None, str]]:
    good = init_weights(CONFIG, 0)
    cfg = CONFIG.to_json()
    missing = {k: v for k, v in good.items() if k != "v_proj.bias"}
    extra = {**good, "rotary.inv_freq": torch.zeros(4)}
    wrong_shape = {**good, "k_proj.weight": torch.zeros(16, 8)}
    wrong_dtype = {**good, "o_proj.weight": torch.zeros(16, 16, dtype=torch.int32)}
    nan = {**good, "q_proj.bias": torch.full((16,), float("nan"))}
    inf = {**good, "q_proj.weight": torch.full((16, 16), float("inf"))}
    return [
        ("missing", missing, cfg, r"missing keys \['v_proj.bias'\]"),
        ("extra", extra, cfg, r"unexpected keys \['rotary.inv_freq'\]"),
        ("shape", wrong_shape, cfg, r"k_proj.weight has shape \(16, 8\); expected \(16, 16\)"),
        ("dtype", wrong_dtype, cfg, r"o_proj.weight has dtype torch.int32; expected a floating dtype"),
        ("nan", nan, cfg, r"q_proj.bias holds 16 non-finite values"),
        ("inf", inf, cfg, r"q_proj.weight holds 256 non-finite values"),
        ("no-metadata", good, None, r"no 'mha_config' metadata"),
        ("bad-json", good, "{not json", r"invalid 'mha_config' metadata: config is not valid JSON"),
        (
            "bad-config",
            good,
            '{"d_model": 16, "n_head": 5}',
            r"invalid 'mha_config' metadata: d_model \(16\) must be divisible",
        ),
        (
            "width-mismatch",
            good,
            MHAConfig(d_model=32, n_head=4).to_json(),
            r"config says d_model=32 but q_proj.weight has shape \(16, 16\)",
        ),
        (
            "bias-mismatch",
            good,
            MHAConfig(d_model=16, n_head=4, bias=False).to_json(),
            r"config says bias=False but the checkpoint has bias",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "tensors", "config_json", "message"),
    _bad_cases(),
    ids=lambda v: v if isinstance(v, str) and len(v) < 16 else "",
)
def test_bad_checkpoint_messages(
    tmp_path: Path, name: str, tensors: dict, config_json: str | None, message: str
) -> None:
    path = _write(tmp_path / f"{name}.safetensors", tensors, config_json)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_every_bad_case_has_its_own_message(tmp_path: Path) -> None:
    messages = set()
    for name, tensors, config_json, _ in _bad_cases():
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(_write(tmp_path / f"{name}.safetensors", tensors, config_json))
        messages.add(str(info.value).split(": ", 1)[-1])
    assert len(messages) == len(_bad_cases())


def test_not_a_file_and_not_safetensors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "absent.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(junk)


def _gpt2_layer(C: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "c_attn.weight": torch.randn(C, 3 * C, generator=gen) * 0.1,  # Conv1D: (in, out)
        "c_attn.bias": torch.randn(3 * C, generator=gen) * 0.1,
        "c_proj.weight": torch.randn(C, C, generator=gen) * 0.1,
        "c_proj.bias": torch.randn(C, generator=gen) * 0.1,
    }


def _fused_reference(x: torch.Tensor, state: dict[str, torch.Tensor], n_head: int, conv1d: bool) -> torch.Tensor:
    """GPT-2's own attention computation on the fused weights (float64)."""
    x = x.double()
    w_attn, w_proj = state["c_attn.weight"].double(), state["c_proj.weight"].double()
    if not conv1d:
        w_attn, w_proj = w_attn.T, w_proj.T
    B, T, C = x.shape
    q, k, v = (x @ w_attn + state["c_attn.bias"].double()).split(C, dim=2)  # (B, T, C) each
    hs = C // n_head
    q, k, v = (t.view(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    att = (q @ k.transpose(-2, -1)) / hs**0.5  # (B, nh, T, T)
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
    return y @ w_proj + state["c_proj.bias"].double()


def test_import_gpt2_conv1d_safetensors(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    layers = {f"h.{i}.attn.{k}": v for i in range(2) for k, v in _gpt2_layer(24, gen).items()}
    path = tmp_path / "gpt2.safetensors"
    save_file(layers, str(path))
    with pytest.raises(CheckpointError, match="2 attention layers found"):
        load_any(path, n_head=3)
    with pytest.raises(CheckpointError, match="pass --n-head"):
        load_any(path, prefix="h.1.attn.")
    config, weights = load_any(path, n_head=3, prefix="h.1.attn.")
    assert (config.d_model, config.n_head, config.bias) == (24, 3, True)
    state = {k.removeprefix("h.1.attn."): v for k, v in layers.items() if k.startswith("h.1.")}
    x = torch.randn(2, 7, 24, generator=gen)
    assert relative_error(attention_view(x, weights, config), _fused_reference(x, state, 3, conv1d=True)) < 1e-12


def test_import_nanogpt_linear_pt(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    conv = _gpt2_layer(32, gen)
    linear = {k: (v.T.contiguous() if v.ndim == 2 else v) for k, v in conv.items()}  # (out, in)
    ckpt = {
        "model": {f"_orig_mod.transformer.h.0.attn.{k}": v for k, v in linear.items()},
        "model_args": {"n_head": 4, "n_embd": 32, "block_size": 128, "bias": True},
    }
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    config, weights = load_any(path)
    assert config == MHAConfig(d_model=32, n_head=4, max_seq_len=128)
    x = torch.randn(3, 5, 32, generator=gen)
    assert relative_error(attention_view(x, weights, config), _fused_reference(x, conv, 4, conv1d=True)) < 1e-12


def test_import_rejects_pickled_code(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": {"c_attn.weight": torch.zeros(3, 1)}, "hook": print}, path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_any(path)


def test_import_rejects_bad_fused_shape(tmp_path: Path) -> None:
    path = tmp_path / "odd.safetensors"
    save_file({"c_attn.weight": torch.zeros(16, 40), "c_proj.weight": torch.zeros(16, 16)}, str(path))
    with pytest.raises(CheckpointError, match=r"expected \(C, 3C\) \(GPT-2 Conv1D\) or \(3C, C\)"):
        load_any(path, n_head=2)


def test_our_checkpoint_takes_a_new_max_seq_len_and_refuses_other_heads(tmp_path: Path) -> None:
    """`mha export --checkpoint ours.safetensors --max-seq-len N` served the stored max_seq_len,
    and `--n-head` was dropped without a word: a model of other heads computes another function."""
    config = MHAConfig(d_model=32, n_head=4, max_seq_len=64)
    weights = init_weights(config, seed=5)
    path = tmp_path / "ours.safetensors"
    save_checkpoint(path, weights, config)
    assert load_any(path)[0] == config
    longer, same = load_any(path, max_seq_len=256)
    assert longer == MHAConfig(d_model=32, n_head=4, max_seq_len=256)
    assert all(torch.equal(same[k], weights[k]) for k in weights)
    assert load_any(path, n_head=4)[0] == config  # the same heads, said again: fine
    with pytest.raises(CheckpointError, match="holds a model of 4 heads; 2 heads would compute another function"):
        load_any(path, n_head=2)
    with pytest.raises(ValueError, match="max_seq_len must be positive"):
        load_any(path, max_seq_len=0)
