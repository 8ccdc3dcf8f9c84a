"""step.onnx: one decode step with past keys and values, exported beside model.onnx and verified
on a (B, past, t) grid against the float64 references of the whole prefix."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from export.pipeline import export_model_dir
from export.step_graph import StepGraphError, build_step_graph
from export.verify import check_step_parity, ort_step_runner, step_parity_grid, verify_model_dir
from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint


def test_exported_beside_model_onnx_and_vouched_for(small_model_dir: Path) -> None:
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["step"] == {
        "file": "step.onnx",
        "inputs": ["x", "past_key", "past_value"],
        "outputs": ["y", "present_key", "present_value"],
    }
    assert "step.onnx" in manifest["files"] and manifest["step_parity"]["ok"]
    grid = [(r["batch"], r["past"], r["seq"]) for r in manifest["step_parity"]["grid"]]
    L = json.loads((small_model_dir / "manifest.json").read_text())["config"]["max_seq_len"]
    assert grid == step_parity_grid(L)
    assert any(p == 0 for _, p, _ in grid) and any(t == 1 for _, _, t in grid)
    assert any(p + t == L for _, p, t in grid), "the grid reaches max_seq_len"
    assert all(r["rel_view"] < 1e-5 and r["rel_einsum"] < 1e-5 for r in manifest["step_parity"]["grid"])


def test_the_interface_is_symbolic_in_batch_new_and_past(small_model_dir: Path) -> None:
    graph = onnx.load(str(small_model_dir / "step.onnx")).graph
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert dims == {
        "x": ["batch", "new", 32],
        "past_key": ["batch", 4, "past", 8],
        "past_value": ["batch", 4, "past", 8],
    }
    assert [n.op_type for n in graph.node].count("Attention") == 1


def test_a_wrong_weight_fails_step_parity(small_model_dir: Path, tmp_path: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    wrong = dict(weights)
    wrong["v_proj.weight"] = weights["v_proj.weight"].clone()
    wrong["v_proj.weight"][3, 5] += 0.05  # one entry of one projection
    path = tmp_path / "step.onnx"
    onnx.save(build_step_graph(config, wrong), str(path))
    report = check_step_parity(ort_step_runner(path), config, weights, step_parity_grid(config.max_seq_len))
    assert not report.ok and "FAIL" in report.table()
    good = check_step_parity(
        ort_step_runner(small_model_dir / "step.onnx"), config, weights, step_parity_grid(config.max_seq_len), seed=5
    )
    assert good.ok, good.table()


def test_a_tampered_step_graph_fails_verification(small_model_dir: Path, tmp_path: Path) -> None:
    for name in ("model.onnx", "weights.safetensors", "manifest.json", "step.onnx"):
        (tmp_path / name).write_bytes((small_model_dir / name).read_bytes())
    assert verify_model_dir(tmp_path).ok
    data = bytearray((tmp_path / "step.onnx").read_bytes())
    data[-40] ^= 0xFF
    (tmp_path / "step.onnx").write_bytes(bytes(data))
    report = verify_model_dir(tmp_path)
    assert not report.ok and any("step.onnx: sha256" in p for p in report.problems)


def test_no_step_graph_for_a_model_that_is_not_causal(tmp_path: Path) -> None:
    config = MHAConfig(d_model=16, n_head=2, max_seq_len=20, causal=False)
    export_model_dir(tmp_path, config, init_weights(config, seed=1))
    assert not (tmp_path / "step.onnx").exists()
    assert "step" not in json.loads((tmp_path / "manifest.json").read_text())
    with pytest.raises(StepGraphError, match="causal"):
        build_step_graph(config, init_weights(config, seed=1))
