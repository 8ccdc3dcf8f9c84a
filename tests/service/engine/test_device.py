"""No silent CPU fallback: --require-device cuda refuses readiness while a CPU backend serves, and
a sticky CUDA error (in a batch, or under the decode caches) stops the replica instead of falling
back onto a broken device."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.backends.base import Backend, Step
from service.backends.chain import BackendChain, is_sticky_device_error
from service.client.client import InferenceError, MHAClient
from service.errors import DeviceLost
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ServerThread, make_settings

INFERENCE = "inference.GRPCInferenceService"


def _health(url: str, service: str) -> str:
    with grpc.insecure_channel(url) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def test_require_cuda_refuses_readiness_on_cpu_and_says_why(
    small_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(small_model_dir, backend="auto", require_device="cuda", http_port=0)
    with ServerThread(settings) as server:
        assert _readiness(server) == {
            "health": "NOT_SERVING",
            "ServerReady": False,
            "ModelReady": False,
            "http ready": 503,
            "http model ready": 503,
            "mha_ready": 0.0,
        }, "every readiness signal says the same"
        assert _health(server.url, "") == "SERVING", "alive: the liveness probe must not restart it in a loop"
        assert server.registry.get_sample_value("mha_device_required", {"device": "cuda"}) == 1
        active = [
            s.labels
            for m in server.registry.collect()
            if m.name == "mha_backend_info"
            for s in m.samples
            if s.value == 1
        ]
        assert active and active[0]["device"] == "cpu"  # what the alert matches on
    assert any("refusing readiness: --require-device cuda" in r.getMessage() for r in caplog.records)
    assert any("decode steps run on the CPU" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def _readiness(server: ServerThread) -> dict[str, object]:
    """The five ways to ask whether the server is ready, as clients and Prometheus ask."""
    port = server.http_port

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        server_ready = stub.ServerReady(pb.ServerReadyRequest(), timeout=5).ready
        model_ready = stub.ModelReady(pb.ModelReadyRequest(name="mha"), timeout=5).ready
    return {
        "health": _health(server.url, INFERENCE),
        "ServerReady": server_ready,
        "ModelReady": model_ready,
        "http ready": status("/v2/health/ready"),
        "http model ready": status("/v2/models/mha/ready"),
        "mha_ready": server.registry.get_sample_value("mha_ready"),
    }


def test_without_the_requirement_cpu_is_ready(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0)) as server:
        assert _readiness(server) == {
            "health": "SERVING",
            "ServerReady": True,
            "ModelReady": True,
            "http ready": 200,
            "http model ready": 200,
            "mha_ready": 1.0,
        }
        assert server.registry.get_sample_value("mha_device_required", {"device": "cuda"}) is None


class BrokenCuda(Backend):
    """Stands in for a CUDA backend whose context a sticky error has broken (no GPU here)."""

    name, device, platform = "ort-cuda", "cuda:0", "onnxruntime_onnx"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_sticky_cuda_error_does_not_fall_back(small_model_dir: Path) -> None:
    class Cpu(Backend):
        name, device, platform = "ort-cpu", "cpu", "onnxruntime_onnx"

        def run(self, x: np.ndarray) -> np.ndarray:
            raise AssertionError("a batch fell back from a broken device")

    chain = BackendChain([BrokenCuda(), Cpu()], probe=lambda b: (True, ""))
    with pytest.raises(DeviceLost, match="illegal memory access"):
        chain.run(np.ones((1, 2, 32), np.float32))
    assert not is_sticky_device_error("cpu", RuntimeError("illegal memory access"))  # only on a CUDA device
    assert not is_sticky_device_error("cuda:0", RuntimeError("CUDA out of memory"))  # not sticky


def test_a_lost_device_stops_the_replica(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as server:
        chain = server.engine.loaded.chain
        broken = BrokenCuda()
        chain.backends.insert(0, broken)  # as if ort-cuda served, then broke
        with MHAClient(server.url) as client:
            with pytest.raises(InferenceError) as first:
                client.infer(np.ones((1, 3, 32), np.float32))
            assert first.value.code == grpc.StatusCode.UNAVAILABLE, "retry elsewhere: not a server fault to give up on"
            assert "lost its device" in str(first.value)
            with pytest.raises(InferenceError) as after:
                client.infer(np.ones((1, 3, 32), np.float32))
            assert after.value.code == grpc.StatusCode.UNAVAILABLE and "lost its device" in str(after.value)
        assert _health(server.url, "") == "NOT_SERVING" and _health(server.url, INFERENCE) == "NOT_SERVING"
        assert server.registry.get_sample_value("mha_ready") == 0
        assert broken.calls == 1


class BrokenCudaSteps(BrokenCuda):
    """Stands in for decode steps on a CUDA device that a sticky error has broken (no GPU here)."""

    name = "torch-cuda"

    @property
    def steps(self) -> bool:
        return True

    def step(self, steps: Sequence[Step]) -> list[np.ndarray]:
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _step(client_stub: pb_grpc.GRPCInferenceServiceStub, start: bool) -> None:
    request = encode_infer_request(np.ones((1, 1, 32), np.float32))
    request.parameters["sequence_id"].int64_param = 7
    request.parameters["sequence_start"].bool_param = start
    client_stub.ModelInfer(request, timeout=10)


def test_a_lost_device_under_the_caches_stops_the_replica(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as server:
        chain = server.engine.loaded.chain
        broken = BrokenCudaSteps()
        chain.step_backends.insert(0, broken)  # as if the steps ran on CUDA, then it broke
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as first:
                _step(stub, start=True)
            assert first.value.code() == grpc.StatusCode.UNAVAILABLE  # retry elsewhere, as docs/api.md says
            with pytest.raises(grpc.RpcError) as after:
                _step(stub, start=True)
            assert after.value.code() == grpc.StatusCode.UNAVAILABLE and "lost its device" in str(after.value)
        assert _health(server.url, "") == "NOT_SERVING" and _health(server.url, INFERENCE) == "NOT_SERVING"
        assert broken.calls == 1
