"""Half precision: model.fp16.onnx (fp32 in and out, fp16 inside) exported beside model.onnx,
verified within a tolerance derived from the format, and served with --precision fp16."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export.layout import precision_tolerance
from export.onnx_export import ExportError
from export.pipeline import export_model_dir
from export.step_graph import build_precision_graph
from export.verify import check_parity, ort_cpu_runner, parity_grid, verify_model_dir
from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint
from model.reference import attention_view, relative_error
from service.client.client import MHAClient
from service.client.parity import verify_server
from service.engine.keeper import ModelLoadError
from tests.support import ServerThread, make_settings

SMALL = MHAConfig(d_model=32, n_head=4, max_seq_len=64)


@pytest.fixture(scope="module")
def half_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("half-model")
    export_model_dir(out, SMALL, init_weights(SMALL, seed=3), precisions=("fp32", "fp16"))
    return out


def test_the_tolerance_comes_from_the_format_and_the_shapes() -> None:
    assert precision_tolerance("fp32", SMALL) == 1e-5
    assert precision_tolerance("fp16", SMALL) == pytest.approx(2**-11 * (2 + 6))  # log2(max(32, 64)) = 6
    assert precision_tolerance("bf16", SMALL) == pytest.approx(2**-8 * (2 + 6))
    assert precision_tolerance("fp16", MHAConfig()) > precision_tolerance("fp16", SMALL)  # longer sums


def test_fp16_graph_is_exported_verified_and_vouched_for(half_model_dir: Path) -> None:
    manifest = json.loads((half_model_dir / "manifest.json").read_text())
    fp16 = manifest["precisions"]["fp16"]
    assert fp16["file"] == "model.fp16.onnx" and fp16["parity"]["ok"]
    assert fp16["tolerance"] == pytest.approx(precision_tolerance("fp16", SMALL))
    assert max(r["rel_view"] for r in fp16["parity"]["grid"]) < fp16["tolerance"]
    assert "model.fp16.onnx" in manifest["files"]
    graph = onnx.load(str(half_model_dir / "model.fp16.onnx")).graph
    assert [i.type.tensor_type.elem_type for i in (*graph.input, *graph.output)] == [onnx.TensorProto.FLOAT] * 2
    assert {t.data_type for t in graph.initializer} == {onnx.TensorProto.FLOAT16}
    assert verify_model_dir(half_model_dir).ok


def test_a_wrong_weight_fails_fp16_parity(tmp_path: Path) -> None:
    weights = init_weights(SMALL, seed=3)
    wrong = dict(weights)
    wrong["v_proj.weight"] = weights["v_proj.weight"].clone()
    wrong["v_proj.weight"][3] += 0.1  # one row of one projection
    path = tmp_path / "model.fp16.onnx"
    onnx.save(build_precision_graph(SMALL, wrong, "fp16"), str(path))
    tolerance = precision_tolerance("fp16", SMALL)
    report = check_parity(ort_cpu_runner(path), SMALL, weights, parity_grid(SMALL.max_seq_len), tolerance=tolerance)
    assert not report.ok, report.table()
    good = tmp_path / "good.onnx"
    onnx.save(build_precision_graph(SMALL, weights, "fp16"), str(good))
    assert check_parity(ort_cpu_runner(good), SMALL, weights, parity_grid(64), tolerance=tolerance).ok


def test_bf16_is_refused_where_the_runtime_cannot_verify_it(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"cannot run model\.bf16\.onnx"):
        export_model_dir(tmp_path / "bf16", SMALL, init_weights(SMALL, seed=3), precisions=("fp32", "bf16"))
    assert list((tmp_path / "bf16").iterdir()) == []


def test_serving_fp16(half_model_dir: Path, small_model_dir: Path) -> None:
    config, weights = load_checkpoint(half_model_dir / "weights.safetensors")
    x = np.random.default_rng(2).standard_normal((2, 17, 32), dtype=np.float32)
    reference = attention_view(torch.from_numpy(x), weights, config)
    for backend in ("ort-cpu", "torch"):
        settings = make_settings(half_model_dir, backend=backend, precision="fp16")
        with ServerThread(settings) as server, MHAClient(server.url) as client:
            error = relative_error(torch.from_numpy(client.infer(x)), reference)
            assert 1e-6 < error < precision_tolerance("fp16", config), (backend, error)  # half, and within bounds
    settings = make_settings(small_model_dir, precision="fp16")
    with ServerThread(settings, wait_ready=False) as server, pytest.raises(ModelLoadError, match="no fp16 graph"):
        server.load()


def test_verify_url_checks_an_fp16_server_at_the_tolerance_of_fp16(half_model_dir: Path, tmp_path: Path) -> None:
    """`mha verify DIR --url` reads the precision the server says it computes in (ModelConfig
    parameter `precision`) and checks at that format's tolerance: an fp16 server passes, and
    other weights of the same shape still fail."""
    settings = make_settings(half_model_dir, backend="ort-cpu", precision="fp16")
    other = tmp_path / "other"
    export_model_dir(other, SMALL, init_weights(SMALL, seed=4))
    with ServerThread(settings) as server:
        with MHAClient(server.url) as client:
            assert client.model_config().parameters["precision"].string_value == "fp16"
        report = verify_server(server.url, half_model_dir)
        assert report.ok, report.table()
        assert {r.tolerance for r in report.routes.values()} == {precision_tolerance("fp16", SMALL)}
        rows = report.routes["gRPC ModelInfer"].rows
        assert max(row.rel_view for row in rows) > 1e-5  # what the fp32 tolerance refused
        assert not verify_server(server.url, other).ok
