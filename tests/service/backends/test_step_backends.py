"""Decode steps go through the backend chain as batches do: the backend `--backend` names computes
them and the response says so, a failing step backend falls back to the next, and a backend whose
steps are wrong never serves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from export.layout import ModelFiles
from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.backends.base import Backend, Step
from service.backends.chain import BackendChain
from service.backends.ort import OrtCpuBackend
from service.backends.pytorch import TorchBackend
from service.backends.selection import BackendSpec, ProbeCache, SelfCheck, select_backends
from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2 as pb
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request
from service.protocol.inference import SEQUENCE_OFFSET
from tests.support import ServerThread, make_settings


@pytest.mark.parametrize("backend", ["ort-cpu", "torch", "auto"])
def test_a_step_is_computed_by_the_chosen_backend_and_says_so(small_model_dir: Path, backend: str) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    x = np.random.default_rng(3).standard_normal((1, 6, 32), dtype=np.float32)
    with ServerThread(make_settings(small_model_dir, backend=backend)) as server, MHAClient(server.url) as client:
        serving = server.engine.loaded.chain.step_backends[0].name
        said, ys = [], []
        for start, end in ((0, 4), (4, 5), (5, 6)):
            request = encode_infer_request(x[:, start:end])
            request.parameters["sequence_id"].string_param = "s"
            request.parameters["sequence_start"].bool_param = start == 0
            request.parameters[SEQUENCE_OFFSET].int64_param = start
            response: pb.ModelInferResponse = client.stub.ModelInfer(request, timeout=30)
            said.append(response.parameters["backend"].string_param)
            ys.append(decode_infer_response(response))
    assert said == [serving] * 3
    assert serving == {"ort-cpu": "ort-cpu", "torch": "torch-cpu"}.get(backend, serving)
    reference = attention_view(torch.from_numpy(x), weights, config)
    assert relative_error(torch.from_numpy(np.concatenate(ys, axis=1)), reference) < 1e-5


class FailingSteps(Backend):
    """A backend whose batches are right and whose steps raise."""

    name, device, platform = "ort-cpu", "cpu", "onnxruntime_onnx"

    def __init__(self, inner: Backend) -> None:
        self.inner, self.calls = inner, 0

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.inner.run(x)

    @property
    def steps(self) -> bool:
        return True

    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        self.calls += 1
        raise RuntimeError("the step graph failed")


def test_a_failing_step_backend_falls_back_and_is_benched(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    torch_cpu = TorchBackend(config, weights)
    failing = FailingSteps(torch_cpu)
    fallbacks: list[tuple[str, str, str]] = []
    chain = BackendChain(
        [failing, torch_cpu],
        probe=lambda b: (True, ""),
        failure_threshold=2,
        on_fallback=lambda *a: fallbacks.append(a),
        step_backends=[failing, torch_cpu],
    )
    x = np.random.default_rng(1).standard_normal((2, 5, 32), dtype=np.float32)
    cache = ProbeCache.empty(2, config, 8, "cpu")
    for _ in range(3):
        (y,), backend = chain.run_steps([Step(cache, x)])
        assert backend is torch_cpu
    assert relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config)) < 1e-5
    assert failing.calls == 2 and chain.quarantined() == ["ort-cpu"]  # quarantined after 2: the third went straight on
    assert fallbacks == [("ort-cpu", "torch-cpu", "error")] * 2


class WrongSteps(FailingSteps):
    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        return [np.zeros_like(s.x) for s in steps]


def test_a_backend_whose_steps_are_wrong_fails_its_self_check(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    check = SelfCheck(config, weights)
    good = OrtCpuBackend(small_model_dir / "model.onnx", threads=1, step_paths=ModelFiles(small_model_dir).steps)
    ok, why = check.passes(good)
    assert ok and "steps" in why, why
    ok, why = check.passes(WrongSteps(TorchBackend(config, weights)))
    assert not ok and "self-check of decode steps" in why, why


def test_selection_orders_the_step_backends_on_one_device(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    spec = BackendSpec(
        small_model_dir / "model.onnx", config, weights, step_paths=ModelFiles(small_model_dir).steps, threads=2
    )
    selection = select_backends(spec, cuda=False)
    assert sorted(b.name for b in selection.step_backends) == ["ort-cpu", "torch-cpu"]
    assert "serves decode steps" in selection.summary() and "step " in selection.summary()
    without = select_backends(BackendSpec(small_model_dir / "model.onnx", config, weights), "ort-cpu", cuda=False)
    assert without.step_backends == []  # no step graph given: ORT computes no steps


def test_the_log_names_the_step_backend_or_why_there_is_none(
    small_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO"), ServerThread(make_settings(small_model_dir, backend="ort-cpu")):
        pass
    messages = [r.getMessage() for r in caplog.records]
    assert "decode steps run on ort-cpu (cpu)" in messages
    assert not any("no backend computes decode steps" in m for m in messages)
    bare = tmp_path / "no-step-graph"  # a model directory exported before the step graphs existed
    bare.mkdir()
    for name in ("model.onnx", "weights.safetensors", "manifest.json"):
        (bare / name).write_bytes((small_model_dir / name).read_bytes())
    caplog.clear()
    settings = make_settings(bare, backend="ort-cpu", allow_unverified=True)
    with caplog.at_level("INFO"), ServerThread(settings) as server, MHAClient(server.url) as client:
        refused = pytest.raises(InferenceError)
        with refused as info:
            client.step("s", np.ones((1, 1, 32), np.float32), 0, start=True)
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED and "no step graphs" in str(info.value)
    assert any("no backend computes decode steps" in r.getMessage() for r in caplog.records)
