"""Exported model directories: graph interface, size, parity on unseen shapes, refusal, verify."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.onnx_export import ExportError
from export.pipeline import ParityError, export_model_dir
from export.verify import parity_grid, verify_model_dir
from model import MHAConfig
from model.checkpoint import init_weights, load_any, load_checkpoint
from model.reference import attention_einsum, attention_view, relative_error
from service.cli import main as mha

UNSEEN = [(1, 3), (9, 37), (2, 63), (3, 64), (11, 5)]


def _ort_parity(model_dir: Path, shapes: list[tuple[int, int]], seed: int = 99) -> list[float]:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(seed)
    errors = []
    for B, T in shapes:
        x = torch.randn(B, T, config.d_model, generator=gen)
        y = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
        errors.append(
            max(
                relative_error(y, attention_view(x, weights, config)),
                relative_error(y, attention_einsum(x, weights, config)),
            )
        )
    return errors


def test_graph_interface_is_symbolic(small_model_dir: Path) -> None:
    model = onnx.load(str(small_model_dir / "model.onnx"))
    for value in (*model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        assert [d.dim_param for d in dims[:2]] == ["batch", "seq"]
        assert dims[2].dim_value == 32
    assert [v.name for v in model.graph.input] == ["x"]
    assert [v.name for v in model.graph.output] == ["y"]
    assert "Attention" in {n.op_type for n in model.graph.node}


def test_unseen_shapes_within_tolerance(small_model_dir: Path) -> None:
    errors = _ort_parity(small_model_dir, UNSEEN)
    assert max(errors) < 1e-5, errors


def test_manifest_records_grid_hashes_and_versions(small_model_dir: Path) -> None:
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["config"] == {"d_model": 32, "n_head": 4, "max_seq_len": 64, "causal": True, "bias": True}
    assert manifest["opset"] == 23
    grid = [(r["batch"], r["seq"]) for r in manifest["parity"]["grid"]]
    # T = 1, 2, 13, 61, max, the largest prime <= max/2 (31); every B from 1 to 8
    assert grid == [(1, 1), (8, 1), (2, 2), (3, 13), (4, 61), (5, 64), (6, 31), (7, 64), (1, 64)]
    assert all(r["rel_view"] < 1e-5 and r["rel_einsum"] < 1e-5 for r in manifest["parity"]["grid"])
    assert set(manifest["versions"]) >= {"torch", "onnx", "onnxruntime"}
    for name in ("model.onnx", "weights.safetensors"):
        assert manifest["files"][name]["sha256"] == hashlib.sha256((small_model_dir / name).read_bytes()).hexdigest()


def test_parity_grid_covers_the_issue() -> None:
    grid = parity_grid(1024)
    ts = {t for _, t in grid}
    assert 1 in ts and 1024 in ts and any(t in (13, 61, 509) for t in ts)
    assert {b for b, _ in grid} == set(range(1, 9))


def test_default_model_size_close_to_weights(default_model_dir: Path) -> None:
    onnx_bytes = (default_model_dir / "model.onnx").stat().st_size
    weights_bytes = (default_model_dir / "weights.safetensors").stat().st_size
    assert onnx_bytes <= 1.25 * weights_bytes, (onnx_bytes, weights_bytes)


def test_file_size_does_not_grow_with_max_seq_len(tmp_path: Path) -> None:
    sizes = []
    for max_len in (16, 1024):  # a mask of max_seq_len squared would add a MiB
        config = MHAConfig(d_model=16, n_head=2, max_seq_len=max_len)
        out = tmp_path / str(max_len)
        export_model_dir(out, config, init_weights(MHAConfig(d_model=16, n_head=2), seed=0))
        sizes.append((out / "model.onnx").stat().st_size)
    assert abs(sizes[0] - sizes[1]) < 64, sizes


def test_an_opset_the_exporter_does_not_write_is_refused(tmp_path: Path, small_config: MHAConfig) -> None:
    """Asked for opset 1, torch's exporter writes 18; manifest.json would have said 1."""
    with pytest.raises(ExportError, match=r"opset 1 was asked for and the exporter wrote \[18\]"):
        export_model_dir(tmp_path / "m", small_config, init_weights(small_config, seed=1), opset=1)
    assert not (tmp_path / "m" / "manifest.json").exists()


@pytest.mark.slow
def test_non_default_config_96_6_300(tmp_path: Path) -> None:
    config = MHAConfig(d_model=96, n_head=6, max_seq_len=300)
    export_model_dir(tmp_path, config, init_weights(config, seed=4))
    assert max(_ort_parity(tmp_path, [(2, 299), (5, 17), (1, 300)])) < 1e-5


def test_non_causal_model(tmp_path: Path) -> None:
    config = MHAConfig(d_model=24, n_head=3, max_seq_len=40, causal=False)
    export_model_dir(tmp_path, config, init_weights(config, seed=4))
    assert max(_ort_parity(tmp_path, [(2, 39), (3, 7)])) < 1e-5
    # and it really is unmasked: the first position depends on the last
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 6, 24), dtype=np.float32)
    x2 = x.copy()
    x2[0, -1] += 1.0
    assert not np.allclose(session.run(None, {"x": x})[0][0, 0], session.run(None, {"x": x2})[0][0, 0])


def test_plain_graph_also_exports(tmp_path: Path, small_config: MHAConfig) -> None:
    export_model_dir(tmp_path, small_config, init_weights(small_config, seed=1), graph="plain")
    assert max(_ort_parity(tmp_path, UNSEEN)) < 1e-5


def test_gpt2_import_exports(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(2)
    C = 48
    save_file(
        {
            "c_attn.weight": torch.randn(C, 3 * C, generator=gen) * 0.1,
            "c_attn.bias": torch.randn(3 * C, generator=gen) * 0.1,
            "c_proj.weight": torch.randn(C, C, generator=gen) * 0.1,
            "c_proj.bias": torch.randn(C, generator=gen) * 0.1,
        },
        str(tmp_path / "gpt2.safetensors"),
    )
    out = tmp_path / "model"
    assert (
        mha(
            [
                "export",
                "--out",
                str(out),
                "--checkpoint",
                str(tmp_path / "gpt2.safetensors"),
                "--n-head",
                "4",
                "--max-seq-len",
                "80",
            ]
        )
        == 0
    )
    config, _ = load_checkpoint(out / "weights.safetensors")
    imported = load_any(tmp_path / "gpt2.safetensors", n_head=4, max_seq_len=80)
    assert config == imported[0] == MHAConfig(d_model=48, n_head=4, max_seq_len=80)
    assert max(_ort_parity(out, [(2, 79), (1, 80)])) < 1e-5


def test_refuses_to_write_a_failing_model(tmp_path: Path, small_config: MHAConfig) -> None:
    out = tmp_path / "strict"
    with pytest.raises(ParityError, match="fails parity") as info:
        export_model_dir(out, small_config, init_weights(small_config, 0), tolerance=1e-12)
    assert "FAIL" in info.value.report.table()
    assert sorted(p.name for p in out.iterdir()) == []


def test_verify_cli_passes_and_catches_corruption(
    small_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mha(["verify", str(small_model_dir)]) == 0
    assert "PASS" in capsys.readouterr().out
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("model.onnx", "weights.safetensors", "manifest.json"):
        (broken / name).write_bytes((small_model_dir / name).read_bytes())
    data = bytearray((broken / "model.onnx").read_bytes())
    data[-100] ^= 0xFF
    (broken / "model.onnx").write_bytes(bytes(data))
    assert mha(["verify", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "model.onnx: sha256" in out and "FAIL" in out
    assert not verify_model_dir(broken).ok


def _nan_runner(x: np.ndarray) -> np.ndarray:
    return np.full(x.shape, np.nan, np.float32)


def test_a_graph_that_answers_nan_fails_parity_and_says_why(small_config: MHAConfig) -> None:
    """NaN compares False with every tolerance: each check must count it as over, not within.
    Before, `mha verify` listed a half-precision graph's failures with `worst > tolerance`, so a
    graph answering NaN passed there."""
    from export.verify import ParityReport, ParityRow, check_parity

    weights = init_weights(small_config, 0)
    report = check_parity(_nan_runner, small_config, weights, [(1, 3), (2, 5)])
    assert not report.ok and len(report.failures()) == 3, report.failures()
    assert "the output is not finite (NaN or inf)" in report.failures()[0]
    second_nan = ParityRow(1, 3, rel_view=1e-7, rel_einsum=float("nan"), abs_view=0.0, abs_einsum=0.0)
    assert not ParityReport(1e-5, rows=[second_nan]).ok  # max(1e-7, nan) is 1e-7: NaN second was dropped


def test_weights_that_overflow_float32_are_refused_with_the_reason(tmp_path: Path, small_config: MHAConfig) -> None:
    weights = {name: w * 1e30 if name.endswith("weight") else w for name, w in init_weights(small_config, 0).items()}
    with pytest.raises(ParityError) as info:
        export_model_dir(tmp_path / "huge", small_config, weights)
    assert "problem: the output is not finite (NaN or inf)" in info.value.report.table()
