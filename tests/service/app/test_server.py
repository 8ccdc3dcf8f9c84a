"""A real server on loopback: parity, every client mistake, metadata, streaming, health, limits."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.app.server import forget_unloaded
from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ComputeGate, ServerThread, make_settings


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, max_message_mb=1, max_request_rows=64)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[MHAClient]:
    with MHAClient(server.url, max_message_mb=4) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.url, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _reference(model_dir: Path, x: np.ndarray) -> torch.Tensor:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    return attention_view(torch.from_numpy(x), weights, config)


def test_infer_matches_reference(client: MHAClient, small_model_dir: Path) -> None:
    for B, T in [(1, 1), (3, 17), (2, 64)]:
        x = np.random.default_rng(B * T).standard_normal((B, T, 32), dtype=np.float32)
        y = client.infer(x)
        assert y.shape == x.shape
        assert relative_error(torch.from_numpy(y), _reference(small_model_dir, x)) < 1e-5


def test_typed_contents_answered_raw(stub: pb_grpc.GRPCInferenceServiceStub, small_model_dir: Path) -> None:
    x = np.random.default_rng(1).standard_normal((1, 5, 32), dtype=np.float32)
    request = pb.ModelInferRequest(model_name="mha", id="typed-1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 5, 32]).contents.fp32_contents.extend(x.ravel().tolist())
    response = stub.ModelInfer(request, timeout=10)
    assert response.id == "typed-1" and response.raw_output_contents and response.outputs[0].shape == [1, 5, 32]
    y = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(1, 5, 32)
    assert relative_error(torch.from_numpy(y.copy()), _reference(small_model_dir, x)) < 1e-5


def _raw(
    shape: list[int], datatype: str = "FP32", name: str = "x", nbytes: int | None = None, **kw: str
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=kw.get("model", "mha"), model_version=kw.get("version", ""))
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    count = int(np.prod(shape)) if shape and min(shape) > 0 else 0
    request.raw_input_contents.append(b"\0" * (nbytes if nbytes is not None else count * 4))
    return request


MISTAKES = [
    ("rank", _raw([4, 32]), grpc.StatusCode.INVALID_ARGUMENT, "rank 2; expected rank 3"),
    ("C", _raw([1, 4, 31]), grpc.StatusCode.INVALID_ARGUMENT, "C = 31; expected C = 32"),
    ("T<1", _raw([1, 0, 32]), grpc.StatusCode.INVALID_ARGUMENT, "T = 0; expected T >= 1"),
    ("T>max", _raw([1, 65, 32]), grpc.StatusCode.INVALID_ARGUMENT, "T = 65 exceeds max_seq_len 64"),
    (
        "datatype",
        _raw([1, 4, 32], datatype="FP64"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "datatype 'FP64'; expected 'FP32'",
    ),
    ("bytes", _raw([1, 4, 32], nbytes=12), grpc.StatusCode.INVALID_ARGUMENT, "holds 12 bytes"),
    ("name", _raw([1, 4, 32], name="inputs"), grpc.StatusCode.INVALID_ARGUMENT, "unknown input 'inputs'"),
    ("model", _raw([1, 4, 32], model="bert"), grpc.StatusCode.NOT_FOUND, "unknown model 'bert'"),
    ("version", _raw([1, 4, 32], version="2"), grpc.StatusCode.NOT_FOUND, "unknown version '2'"),
    ("rows", _raw([65, 1, 32]), grpc.StatusCode.INVALID_ARGUMENT, "B = 65 exceeds this server's limit of 64"),
]


@pytest.mark.parametrize(("name", "request_", "code", "message"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_client_mistakes_get_precise_status(
    stub: pb_grpc.GRPCInferenceServiceStub,
    client: MHAClient,
    name: str,
    request_: pb.ModelInferRequest,
    code: grpc.StatusCode,
    message: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert client.infer(np.zeros((1, 2, 32), np.float32)).shape == (1, 2, 32)  # still serving


def test_oversized_message_is_resource_exhausted(stub: pb_grpc.GRPCInferenceServiceStub, client: MHAClient) -> None:
    x = np.zeros((64, 64, 32), np.float32)  # 512 KiB: under 1 MiB
    stub.ModelInfer(encode_infer_request(x), timeout=30)
    big = np.zeros((4, 64, 32 * 40), np.float32)  # 1.25 MiB > --max-message-mb 1
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(encode_infer_request(big), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (info.value.details() or "")
    assert client.infer(np.zeros((1, 3, 32), np.float32)).shape == (1, 3, 32)


def test_readiness_and_metadata(server: ServerThread, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="mha")).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="mha", version="1")).ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name="nope")).ready  # as Triton answers: no error
    assert not stub.ModelReady(pb.ModelReadyRequest(name="mha", version="7")).ready
    meta = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "mha-serve" and "sequence" in meta.extensions and "model_repository" in meta.extensions
    assert "system_shared_memory" not in meta.extensions  # --shared-memory off
    assert "schedule_policy" in meta.extensions  # priority levels and queue policies (docs/operations.md)
    assert not any(e.startswith("backend:") for e in meta.extensions)  # what serves is in ModelConfig
    model = stub.ModelMetadata(pb.ModelMetadataRequest(name="mha"))
    assert model.versions == ["1"] and model.platform == "onnxruntime_onnx"  # stable, whichever backend computes
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("x", "FP32", [-1, -1, 32])]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [("y", "FP32", [-1, -1, 32])]


def test_model_config_says_which_backend_and_why(server: ServerThread, client: MHAClient) -> None:
    config = client.model_config()
    assert config.name == "mha" and config.max_batch_size == 64
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", pb.TYPE_FP32, [-1, 32])]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["backend"] == server.engine.loaded.chain.active.name
    assert "self-check relative error" in params["selection"]
    assert params["max_seq_len"] == "64"
    # As a Triton tool reads them: the largest B per request, the batcher's own row limit beside
    # it, and a platform that does not change with the backend measured at start
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")  # as Triton fills them
    assert params["max_batch_rows"] == str(server.engine.settings.max_batch_size)
    assert params["backend_platform"] == server.engine.loaded.chain.active.platform


def test_statistics_count_rows_and_executions(client: MHAClient) -> None:
    before = client.statistics()
    client.infer(np.zeros((3, 4, 32), np.float32))
    after = client.statistics()
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 1
    assert after.inference_stats.success.count - before.inference_stats.success.count == 1
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert after.last_inference >= before.last_inference and after.last_inference > 0


def test_statistics_hold_tritons_invariants_for_requests_and_steps(small_model_dir: Path) -> None:
    """As perf_analyzer reads them: compute_input, compute_infer and compute_output counted once per
    successful request, as many as queue and success; each batch size's three counts equal, and
    their sum the executions; inference_count the rows. Stateless requests count under `mha`,
    decode steps under `mha_sequence`."""
    gate = ComputeGate(held=())
    settings = make_settings(small_model_dir, backend="torch", max_batch_size=8, max_queue_delay_ms=20)
    with ServerThread(settings, compute_hook=gate) as server, MHAClient(server.url) as client:
        batcher, requests = server.engine.loaded.batcher, server.engine.requests
        # the first batch waits until 3 more queue, or until all 4 are in (one batch may take several)
        gate.hold_next(lambda: batcher.depth >= 3 or requests.uncomputed >= 4)
        xs = [np.random.default_rng(i).standard_normal((1 + i % 2, 5, 32), dtype=np.float32) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(client.infer, xs))
        sequence = client.sequence("stats")
        for i in range(3):
            sequence.send(xs[0][:1, i : i + 1])
        stats = client.statistics()
        with MHAClient(server.url, model="mha_sequence") as steps_client:
            steps = steps_client.statistics()
    for entry, answered, rows in ((stats, 4, sum(x.shape[0] for x in xs)), (steps, 3, 3)):
        inference = entry.inference_stats
        assert inference.success.count == inference.queue.count == answered, entry.name
        assert inference.compute_input.count == inference.compute_infer.count == inference.compute_output.count
        assert inference.compute_infer.count == answered and inference.compute_infer.ns > 0
        assert inference.fail.count == 0 and entry.inference_count == rows
        per_size = [(b.compute_input.count, b.compute_infer.count, b.compute_output.count) for b in entry.batch_stats]
        assert all(a == b == c for a, b, c in per_size)
        assert sum(a for a, _, _ in per_size) == entry.execution_count
    assert stats.execution_count < 4  # some stateless requests shared a batch


def test_streaming_keeps_going_after_an_error(stub: pb_grpc.GRPCInferenceServiceStub, small_model_dir: Path) -> None:
    xs = [np.random.default_rng(i).standard_normal((1, 3 + i, 32), dtype=np.float32) for i in range(4)]
    requests = [encode_infer_request(x, request_id=f"r{i}") for i, x in enumerate(xs)]
    bad = encode_infer_request(np.zeros((1, 2, 16), np.float32), request_id="bad")
    responses = list(stub.ModelStreamInfer(iter([requests[0], bad, *requests[1:]]), timeout=30))
    assert len(responses) == 5
    by_id = {r.infer_response.id: r for r in responses}
    assert "INVALID_ARGUMENT" in by_id["bad"].error_message and "C = 16" in by_id["bad"].error_message
    for i, x in enumerate(xs):
        r = by_id[f"r{i}"]
        assert r.error_message == ""
        y = np.frombuffer(r.infer_response.raw_output_contents[0], np.float32).reshape(x.shape)
        assert relative_error(torch.from_numpy(y.copy()), _reference(small_model_dir, x)) < 1e-5


def test_client_stream_infer(client: MHAClient) -> None:
    xs = [np.ones((1, t, 32), np.float32) for t in (1, 5, 9)]
    assert [y.shape for y in client.stream_infer(xs)] == [(1, 1, 32), (1, 5, 32), (1, 9, 32)]


def test_health_and_reflection(server: ServerThread) -> None:
    with grpc.insecure_channel(server.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(
            reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_cuda_shared_memory_turned_off_is_refused_with_what_to_do_instead(server: ServerThread) -> None:
    """UNIMPLEMENTED from our servicer (counted in our metrics, with our message), not from gRPC."""
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(name="gpu", byte_size=64), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--shared-memory cuda" in (info.value.details() or "")
    labels = {"method": "CudaSharedMemoryRegister", "code": "UNIMPLEMENTED"}
    assert (server.registry.get_sample_value("mha_requests_total", labels) or 0) >= 1


def test_inference_error_carries_code(client: MHAClient) -> None:
    with pytest.raises(InferenceError) as info:
        client.infer(np.zeros((1, 2, 3), np.float32))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_not_ready_while_loading(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir), wait_ready=False) as s, grpc.insecure_channel(s.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(encode_infer_request(np.zeros((1, 2, 32), np.float32)), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in info.value.details()
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        s.load()
        assert stub.ServerReady(pb.ServerReadyRequest()).ready


def test_a_drain_answers_what_is_in_flight_and_refuses_what_comes_after(small_model_dir: Path) -> None:
    """Computes held at a gate, so that the test decides what is in flight when the drain begins:
    4 requests (one computing, three queued) are answered exactly after it began, a new one is
    refused UNAVAILABLE, and the server stops once they are answered."""
    from service.app.server import drain_and_stop

    settings = make_settings(small_model_dir, backend="torch", max_batch_size=1)
    gate = ComputeGate(held=("batch",))
    permits = gate.permits
    with ServerThread(settings, compute_hook=gate) as server:
        xs = [np.random.default_rng(i).standard_normal((1, 5, 32), dtype=np.float32) for i in range(4)]
        answers: dict[int, object] = {}

        def one(i: int) -> None:
            with MHAClient(server.url) as client:
                try:
                    answers[i] = client.infer(xs[i], timeout=60)
                except InferenceError as exc:
                    answers[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        while server.engine.requests.count < 4:  # all four in the server, none computed
            threading.Event().wait(0.01)
        assert server.running is not None
        draining = server.submit(drain_and_stop(server.running, 30.0))
        while not server.engine.life.draining.is_set():
            threading.Event().wait(0.01)
        with MHAClient(server.url) as late, pytest.raises(InferenceError) as info:
            late.infer(xs[0], timeout=10)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in str(info.value)
        assert not draining.done(), "the drain waits for the requests in flight"
        permits.release(4)
        draining.result(60)
        server.running = None
        for thread in threads:
            thread.join(30)
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    for i, x in enumerate(xs):
        y = answers[i]
        assert isinstance(y, np.ndarray), y
        assert relative_error(torch.from_numpy(y.copy()), attention_view(torch.from_numpy(x), weights, config)) < 1e-5


class _FailsOnce:
    """A collector whose first read fails; each read counted."""

    def __init__(self) -> None:
        self.reads = 0

    def collect(self) -> list[object]:
        self.reads += 1
        if self.reads == 1:
            raise RuntimeError("a collector that failed once")
        return []


@pytest.mark.parametrize(("grace_s", "period_s"), [(0.0, 1.0), (10.0, 10.0), (300.0, 60.0)])
def test_the_look_for_unloaded_versions_outlives_a_failed_read(
    grace_s: float, period_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry(auto_describe=False)
    collector = _FailsOnce()
    registry.register(collector)  # type: ignore[arg-type]
    periods: list[float] = []

    async def sleep(seconds: float) -> None:  # the clock: three periods, then the look is stopped
        periods.append(seconds)
        if len(periods) > 3:
            raise asyncio.CancelledError
        await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(forget_unloaded(registry, grace_s, sleep))
    assert periods == [period_s] * 4
    assert collector.reads == 3  # read again after the read that failed
    assert "looking for unloaded model versions failed" in caplog.text
