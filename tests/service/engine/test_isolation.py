"""One client cannot hurt the others: inputs that overflow attention, or hold NaN or inf, fail
alone and quarantine nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request
from tests.support import ComputeGate, ServerThread, make_settings

POISONS = {  # both backends overflow on these (checked in the tests: nothing may be quarantined)
    "1e20": np.random.default_rng(3).standard_normal((1, 8, 32), dtype=np.float32) * np.float32(1e20),
    "max": np.full((1, 8, 32), 3.4e38, np.float32),
}


NON_FINITE = {  # the server looks at the input only once the output shows them (Door.infer)
    "nan": np.where(np.arange(8 * 32).reshape(1, 8, 32) % 50 == 7, np.nan, 0.5).astype(np.float32),
    "-inf": np.concatenate([np.ones((1, 7, 32), np.float32), np.full((1, 1, 32), -np.inf, np.float32)], axis=1),
}


GATE = ComputeGate(held=())  # the module's servers' compute hook: holds a compute when a test asks


def _exact(model_dir: Path, x: np.ndarray, y: np.ndarray) -> bool:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    return relative_error(torch.from_numpy(y.copy()), attention_view(torch.from_numpy(x), weights, config)) < 1e-5


@pytest.fixture(scope="module", params=["auto", "torch"], ids=["two-backends", "one-backend"])
def server(request: pytest.FixtureRequest, small_model_dir: Path) -> Iterator[ServerThread]:
    settings = make_settings(small_model_dir, backend=request.param, max_batch_size=16, max_queue_delay_ms=20)
    with ServerThread(settings, compute_hook=GATE) as s:
        yield s


def _nothing_benched(server: ServerThread) -> None:
    assert server.engine.loaded.chain.quarantined() == []
    fallbacks = [s for m in server.registry.collect() if m.name == "mha_backend_fallbacks" for s in m.samples]
    assert all(s.value == 0 for s in fallbacks if s.name.endswith("_total")), fallbacks


@pytest.mark.parametrize("poison", POISONS.values(), ids=POISONS.keys())
def test_an_overflowing_input_is_the_clients_mistake(server: ServerThread, small_model_dir: Path, poison) -> None:
    with MHAClient(server.url) as client:
        for _ in range(5):  # more than --fallback-failures: a backend blamed for these would be quarantined
            with pytest.raises(InferenceError) as info:
                client.infer(poison)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "overflow float32 inside attention" in str(info.value)
        x = np.random.default_rng(0).standard_normal((2, 8, 32), dtype=np.float32)
        assert _exact(small_model_dir, x, client.infer(x))
    _nothing_benched(server)


@pytest.mark.parametrize("bad", NON_FINITE.values(), ids=NON_FINITE.keys())
def test_nan_or_inf_in_the_input_is_named(server: ServerThread, small_model_dir: Path, bad: np.ndarray) -> None:
    count = int(np.count_nonzero(~np.isfinite(bad)))
    with MHAClient(server.url) as client:
        for _ in range(5):
            with pytest.raises(InferenceError) as info:
                client.infer(bad)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"the input holds {count} NaN or inf values; expected finite floats" in str(info.value)
        x = np.random.default_rng(0).standard_normal((2, 8, 32), dtype=np.float32)
        assert _exact(small_model_dir, x, client.infer(x))
    _nothing_benched(server)


def test_innocent_requests_sharing_a_batch_with_a_poison_are_answered(
    server: ServerThread, small_model_dir: Path
) -> None:
    rng = np.random.default_rng(1)
    poisons = [POISONS["1e20"], NON_FINITE["nan"]]
    xs = [poisons[i % 2] if i % 3 == 0 else rng.standard_normal((1, 8, 32), dtype=np.float32) for i in range(45)]
    requests = [encode_infer_request(x, request_id=str(i)) for i, x in enumerate(xs)]
    batcher = server.engine.loaded.batcher
    GATE.hold_next(lambda: batcher.depth >= 8)  # the first compute waits: the stream queues up
    with grpc.insecure_channel(server.url) as channel:
        responses = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=60))
    assert len(responses) == 45
    for response in responses:
        i = int(response.infer_response.id)
        if i % 3 == 0:
            assert response.error_message.startswith("INVALID_ARGUMENT:")
            assert ("overflow" if i % 2 == 0 else "holds 5 NaN or inf values") in response.error_message
        else:
            assert not response.error_message, response.error_message
            assert _exact(small_model_dir, xs[i], decode_infer_response(response.infer_response))
    with server.engine.publish.statistics("1") as stats:
        batches = dict(stats.batches)
    assert max(batches) > 1, "the stream's requests never shared a batch: the test proves nothing"
    _nothing_benched(server)


def test_a_request_over_the_attention_budget_is_refused_before_compute(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, backend="torch", max_attention_mb=1)  # 4 heads: (16, 64) is 1 MiB
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        assert client.infer(np.zeros((16, 64, 32), np.float32)).shape == (16, 64, 32)
        with pytest.raises(InferenceError) as info:
            client.infer(np.zeros((17, 64, 32), np.float32))
        with server.engine.publish.statistics("1") as stats:
            executed = stats.execution_count
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "attention needs 1 MiB" in str(info.value) and "limit is 1 MiB per request" in str(info.value)
    assert executed == 1  # the first request only


def test_a_batch_that_fails_fails_only_the_request_to_blame(small_model_dir: Path) -> None:
    """A compute that raises for one request's input (as a backend fault would) fails the batch it
    rode in; each request is then computed on its own, and only the culprit gets the error."""
    poison = np.float32(7.25)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, 8, 32), dtype=np.float32) for _ in range(6)]
    xs[3][0, 4, 7] = poison
    gate = ComputeGate(held=("batch",), poison=float(poison))
    settings = make_settings(small_model_dir, backend="torch", max_batch_size=16, max_queue_delay_ms=20)
    with ServerThread(settings, compute_hook=gate) as server, MHAClient(server.url) as client:
        blocker = client.stub.ModelInfer.future(encode_infer_request(xs[0]), timeout=60)
        gate.arrived()  # the first request computes (held): the others queue behind it
        futures = [client.stub.ModelInfer.future(encode_infer_request(x), timeout=60) for x in xs[1:]]
        deadline = time.monotonic() + 30
        while server.engine.requests.count < len(answers := [blocker, *futures]):
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.002)
        gate.held = ()
        gate.permits.release()
        for i, future in enumerate(answers):
            if i == 3:
                with pytest.raises(grpc.RpcError) as info:
                    future.result()
                assert info.value.code() == grpc.StatusCode.INTERNAL, info.value
            else:
                assert _exact(small_model_dir, xs[i], decode_infer_response(future.result()))
    assert ("batch", 5) in gate.computed, f"the five queued requests never shared a batch: {gate.computed}"
