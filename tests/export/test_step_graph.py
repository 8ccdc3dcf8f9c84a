"""The step graphs: one decode step with the sequence's cache read where it lies, exported beside
model.onnx and verified on a (B, past, t) grid against the float64 references of the whole prefix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from export.layout import ModelFiles
from export.pipeline import export_model_dir
from export.step_graph import StepGraphError, build_step_graphs
from export.verify import check_step_parity, ort_step_runner, step_parity_grid, verify_model_dir
from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint

STEP_FILES = ("step_project.onnx", "step_attend.onnx")


def test_exported_beside_model_onnx_and_vouched_for(small_model_dir: Path) -> None:
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["step"] == {
        "project": {"file": "step_project.onnx", "inputs": ["x"], "outputs": ["query", "key", "value"]},
        "attend": {
            "file": "step_attend.onnx",
            "inputs": ["query", "key_cache", "value_cache", "past_length"],
            "outputs": ["y"],
        },
    }
    assert all(name in manifest["files"] for name in STEP_FILES) and manifest["step_parity"]["ok"]
    grid = [(r["batch"], r["past"], r["seq"]) for r in manifest["step_parity"]["grid"]]
    L = manifest["config"]["max_seq_len"]
    assert grid == step_parity_grid(L)
    assert any(p == 0 for _, p, _ in grid) and any(t == 1 for _, _, t in grid)
    assert any(p + t == L for _, p, t in grid), "the grid reaches max_seq_len"
    assert all(r["rel_view"] < 1e-5 and r["rel_einsum"] < 1e-5 for r in manifest["step_parity"]["grid"])


def _dims(path: Path) -> dict[str, list[object]]:
    graph = onnx.load(str(path)).graph
    return {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in graph.input}


def test_the_interfaces_are_symbolic_in_rows_new_and_capacity(small_model_dir: Path) -> None:
    project, attend = ModelFiles(small_model_dir).steps
    assert _dims(project) == {"x": ["rows", "new", 32]}
    assert _dims(attend) == {
        "query": ["rows", 4, "new", 8],
        "key_cache": ["rows", 4, "capacity", 8],
        "value_cache": ["rows", 4, "capacity", 8],
        "past_length": [],
    }
    ops = [n.op_type for n in onnx.load(str(attend)).graph.node]
    assert ops.count("Attention") == 1 and "Concat" not in ops  # the cache is attended, never copied


def test_the_positions_past_the_new_tokens_are_never_seen(small_model_dir: Path) -> None:
    """What lies in the cache beyond past + t (zeros, a failed step's keys) does not change y."""
    import onnxruntime as ort

    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    _, attend = ModelFiles(small_model_dir).steps
    session = ort.InferenceSession(str(attend), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    nh, hs = config.n_head, config.head_size
    query = rng.standard_normal((2, nh, 3, hs), dtype=np.float32)
    caches = [rng.standard_normal((2, nh, 16, hs), dtype=np.float32) for _ in range(2)]
    feeds = {"query": query, "key_cache": caches[0], "value_cache": caches[1], "past_length": np.array(5)}
    (y,) = session.run(["y"], feeds)
    for cache in caches:
        cache[:, :, 8:] = 1e3 * rng.standard_normal((2, nh, 8, hs), dtype=np.float32)  # beyond 5 + 3
    (again,) = session.run(["y"], feeds)
    np.testing.assert_array_equal(y, again)
    caches[0][:, :, 7] += 1.0  # the last new token's key: seen by the last query
    (changed,) = session.run(["y"], feeds)
    assert not np.array_equal(changed[:, 2], y[:, 2]) and np.array_equal(changed[:, :2], y[:, :2])


def test_a_wrong_weight_fails_step_parity(small_model_dir: Path, tmp_path: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    wrong = dict(weights)
    wrong["v_proj.weight"] = weights["v_proj.weight"].clone()
    wrong["v_proj.weight"][3, 5] += 0.05  # one entry of one projection
    paths = (tmp_path / STEP_FILES[0], tmp_path / STEP_FILES[1])
    for model, path in zip(build_step_graphs(config, wrong), paths, strict=True):
        onnx.save(model, str(path))
    report = check_step_parity(ort_step_runner(*paths), config, weights, step_parity_grid(config.max_seq_len))
    assert not report.ok and "FAIL" in report.table()
    steps = ModelFiles(small_model_dir).steps
    good = check_step_parity(ort_step_runner(*steps), config, weights, step_parity_grid(config.max_seq_len), seed=5)
    assert good.ok, good.table()


def test_present_keys_of_nan_fail_step_parity(small_model_dir: Path) -> None:
    """The step's y right and its present keys NaN: before, `NaN > tolerance` let them pass."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    run = ort_step_runner(*ModelFiles(small_model_dir).steps)

    def nan_keys(*inputs: np.ndarray) -> tuple[np.ndarray, ...]:
        y, present_key, present_value = run(*inputs)
        return y, np.full_like(present_key, np.nan), present_value

    report = check_step_parity(nan_keys, config, weights, step_parity_grid(config.max_seq_len)[:2])
    assert not report.ok and "present keys / values off by nan" in report.table(), report.table()


@pytest.mark.parametrize("name", STEP_FILES)
def test_a_tampered_step_graph_fails_verification(small_model_dir: Path, tmp_path: Path, name: str) -> None:
    for file in ("model.onnx", "weights.safetensors", "manifest.json", *STEP_FILES):
        (tmp_path / file).write_bytes((small_model_dir / file).read_bytes())
    assert verify_model_dir(tmp_path).ok
    data = bytearray((tmp_path / name).read_bytes())
    data[-40] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(data))
    report = verify_model_dir(tmp_path)
    assert not report.ok and any(f"{name}: sha256" in p for p in report.problems)


def test_no_step_graphs_for_a_model_that_is_not_causal(tmp_path: Path) -> None:
    config = MHAConfig(d_model=16, n_head=2, max_seq_len=20, causal=False)
    export_model_dir(tmp_path, config, init_weights(config, seed=1))
    assert not any((tmp_path / name).exists() for name in STEP_FILES)
    assert "step" not in json.loads((tmp_path / "manifest.json").read_text())
    with pytest.raises(StepGraphError, match="causal"):
        build_step_graphs(config, init_weights(config, seed=1))
