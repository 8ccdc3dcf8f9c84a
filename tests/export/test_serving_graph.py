"""The graph ORT-CPU serves: model.onnx in 6 nodes instead of 21, computing the same numbers
(against model.onnx itself and both float64 references), for every shape of model we export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.pipeline import export_model_dir
from export.serving_graph import serving_graph
from export.verify import check_parity, parity_grid
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


def test_the_rewritten_graph_computes_what_model_onnx_computes(model_dir: Path) -> None:
    model = onnx.load(str(model_dir / "model.onnx"))
    rewritten, done = serving_graph(model)
    assert done == BOTH and len(rewritten.graph.node) < len(model.graph.node)
    assert {n.op_type for n in rewritten.graph.node} <= {"MatMul", "Add", "Split", "Attention"}
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    plain, served = _session(model), _session(rewritten)
    report = check_parity(lambda x: served.run(None, {"x": x})[0], config, weights, parity_grid(config.max_seq_len))
    assert report.ok, report.table()
    x = np.random.default_rng(5).standard_normal((3, 17, config.d_model), dtype=np.float32)
    expected = plain.run(None, {"x": x})[0]
    assert np.allclose(served.run(None, {"x": x})[0], expected, rtol=1e-6, atol=1e-7)


def test_the_cpu_backend_serves_the_rewritten_graph_exactly(small_model_dir: Path) -> None:
    backend = OrtCpuBackend(small_model_dir / "model.onnx", threads=2, width=32)
    assert backend.rewrites == BOTH
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


def test_heads_merged_to_another_width_are_left_as_they_are(small_model_dir: Path) -> None:
    """The heads are handed to Attention only when the Reshape after it merges them back into
    exactly nh x hs: a graph that reshapes to anything else keeps its own nodes."""
    model = onnx.load(str(small_model_dir / "model.onnx"))
    merge = next(n for n in model.graph.node if n.op_type == "Reshape" and n.input[0].startswith("transpose"))
    concat = next(n for n in model.graph.node if merge.input[1] in n.output)
    width = next(t for t in model.graph.initializer if t.name == concat.input[-1])
    width.CopyFrom(numpy_helper.from_array(np.array([64], dtype=np.int64), width.name))  # not 4 heads x 8
    _, done = serving_graph(model)
    assert done == ["fuse_projections"]
