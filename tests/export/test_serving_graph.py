"""The graph ORT serves: `mha export` rewrites model.onnx for serving before it verifies it (6
nodes instead of 21), so that manifest.json vouches for the file ORT serves. The rewritten graph
computes the same numbers as the exported one and both float64 references, for every shape of
model we export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.onnx_export import export_onnx
from export.pipeline import export_model_dir
from export.serving_graph import serving_graph
from export.verify import check_parity, parity_grid, sha256_file
from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint
from model.reference import attention_view, relative_error
from service.backends.ort import OrtCpuBackend

BOTH = ["fuse_projections", "attend_on_3d"]


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=["default-shape", "no-bias", "not-causal"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "default-shape": MHAConfig(d_model=32, n_head=4, max_seq_len=64),
        "no-bias": MHAConfig(d_model=48, n_head=6, max_seq_len=40, bias=False),
        "not-causal": MHAConfig(d_model=32, n_head=2, max_seq_len=40, causal=False),
    }[request.param]
    out = tmp_path_factory.mktemp(request.param)
    export_model_dir(out, config, init_weights(config, seed=11))
    return out


def _exported(model_dir: Path, tmp_path: Path) -> onnx.ModelProto:
    """The graph the exporter writes before the serving rewrites, for the model in `model_dir`."""
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    export_onnx(config, weights, tmp_path / "exported.onnx")
    return onnx.load(str(tmp_path / "exported.onnx"))


def test_the_manifest_vouches_for_the_rewritten_file(model_dir: Path) -> None:
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["serving_rewrites"] == BOTH
    assert manifest["files"]["model.onnx"]["sha256"] == sha256_file(model_dir / "model.onnx")
    served = onnx.load(str(model_dir / "model.onnx"))
    assert {n.op_type for n in served.graph.node} <= {"MatMul", "Add", "Split", "Attention"}
    assert serving_graph(served)[1] == [], "nothing is left to rewrite at load"


def test_the_rewritten_graph_computes_what_the_exported_graph_computes(model_dir: Path, tmp_path: Path) -> None:
    model = _exported(model_dir, tmp_path)
    rewritten = onnx.load(str(model_dir / "model.onnx"))
    assert len(rewritten.graph.node) < len(model.graph.node)
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    plain, served = _session(model), _session(rewritten)
    report = check_parity(lambda x: served.run(None, {"x": x})[0], config, weights, parity_grid(config.max_seq_len))
    assert report.ok, report.table()
    x = np.random.default_rng(5).standard_normal((3, 17, config.d_model), dtype=np.float32)
    expected = plain.run(None, {"x": x})[0]
    assert np.allclose(served.run(None, {"x": x})[0], expected, rtol=1e-6, atol=1e-7)


def test_the_cpu_backend_serves_the_rewritten_graph_exactly(small_model_dir: Path) -> None:
    backend = OrtCpuBackend(small_model_dir / "model.onnx", threads=2, width=32)
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    x = np.random.default_rng(2).standard_normal((2, 23, 32), dtype=np.float32)
    reference = attention_view(torch.from_numpy(x), weights, config)
    assert relative_error(torch.from_numpy(backend.run(x)), reference) < 1e-5


def test_a_graph_of_another_shape_is_served_as_it_is() -> None:
    """Two projections of x, no heads around an Attention: nothing to rewrite, nothing changed."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.5] * 16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("MatMul", ["x", "w"], ["b"])]
    nodes.append(helper.make_node("Add", ["a", "b"], ["y"]))
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "other", [value("x", TensorProto.FLOAT, [1, 4])], [value("y", TensorProto.FLOAT, [1, 4])], [weight]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    rewritten, done = serving_graph(model)
    assert done == [] and rewritten == model


def test_heads_merged_to_another_width_are_left_as_they_are(small_model_dir: Path, tmp_path: Path) -> None:
    """The heads are handed to Attention only when the Reshape after it merges them back into
    exactly nh x hs: a graph that reshapes to anything else keeps its own nodes."""
    model = _exported(small_model_dir, tmp_path)
    merge = next(n for n in model.graph.node if n.op_type == "Reshape" and n.input[0].startswith("transpose"))
    concat = next(n for n in model.graph.node if merge.input[1] in n.output)
    width = next(t for t in model.graph.initializer if t.name == concat.input[-1])
    width.CopyFrom(numpy_helper.from_array(np.array([64], dtype=np.int64), width.name))  # not 4 heads x 8
    _, done = serving_graph(model)
    assert done == ["fuse_projections"]
