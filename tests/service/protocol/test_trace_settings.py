"""Triton's trace settings on both protocols, mapped onto OpenTelemetry: read, turned off and on,
the rate changed while the server runs, with spans received (or not) by a real OTLP receiver; a
setting this server cannot honour is refused with the reason, and nothing changes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.client.client import MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from tests.otlp_receiver import OtlpReceiver
from tests.support import ServerThread, http_json, make_settings

X = np.ones((1, 3, 32), np.float32)


@pytest.fixture
def traced(small_model_dir: Path) -> Iterator[tuple[ServerThread, OtlpReceiver]]:
    with OtlpReceiver() as receiver:
        settings = make_settings(small_model_dir, http_port=0, backend="torch", otlp_endpoint=receiver.endpoint)
        with ServerThread(settings) as server:
            yield server, receiver


def _grpc(server: ServerThread, model: str = "", **settings: list[str]) -> dict[str, list[str]]:
    request = pb.TraceSettingRequest(model_name=model)
    for key, values in settings.items():
        request.settings[key].value.extend(values)
    with grpc.insecure_channel(server.url) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).TraceSetting(request, timeout=10)
    return {key: list(value.value) for key, value in response.settings.items()}


def _http(server: ServerThread, path: str = "/v2/trace/setting", body: dict | None = None) -> tuple[int, dict]:
    return http_json(server.http_port, path, body)


def _calls_traced(server: ServerThread, receiver: OtlpReceiver, count: int = 3) -> int:
    """Calls without a client's trace, and how many of them the receiver got a span of."""
    before = len(receiver.named("ModelInfer"))
    with MHAClient(server.url) as client:
        for _ in range(count):
            client.infer(X)
    assert server.engine.tracing.flush(), "the exporter did not deliver in time"
    return len(receiver.named("ModelInfer")) - before


def test_tracing_turns_off_and_on_and_its_rate_changes_at_run_time(traced: tuple[ServerThread, OtlpReceiver]) -> None:
    server, receiver = traced
    assert _grpc(server) == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": ["1"],
        "trace_count": ["-1"],
        "log_frequency": ["0"],
        "trace_file": [""],
        "trace_mode": ["opentelemetry"],
    }
    assert _calls_traced(server, receiver) == 3
    assert _grpc(server, trace_level=["OFF"])["trace_level"] == ["OFF"]
    assert _calls_traced(server, receiver) == 0
    status, settings = _http(server, "/v2/models/mha/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "0"})
    assert status == 200 and settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "0"
    assert _calls_traced(server, receiver) == 0  # rate 0: only calls carrying a client's trace
    status, settings = _http(server, body={"trace_rate": None})  # null: back to the value at start
    assert status == 200 and settings["trace_rate"] == "1" and settings["trace_count"] == "-1"
    assert _calls_traced(server, receiver) == 3
    assert _http(server) == (200, settings)  # GET reads them


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"trace_file": ["/tmp/trace.json"]}, "spans go over OTLP"),
        ({"trace_level": ["TENSORS"]}, "tensors are not traced"),
        ({"trace_rate": ["fast"]}, "expected one count N"),
        ({"trace_rate": ["²"]}, "expected one count N from 0 to 4294967295"),  # a digit int() cannot read
        ({"trace_rate": [str(2**32)]}, "expected one count N from 0 to 4294967295"),
        ({"trace_rate": ["1"] * 1000}, "['1', '1', '1', '1'] and 996 more: expected one count N"),
        ({"trace_count": ["10"]}, "no limit"),
        ({"trace_mode": ["triton"]}, "OpenTelemetry"),
        ({"trace_colour": ["red"]}, "expected one of trace_level"),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused(
    traced: tuple[ServerThread, OtlpReceiver], settings: dict, says: str
) -> None:
    server, _ = traced
    with pytest.raises(grpc.RpcError) as info:
        _grpc(server, **settings)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details()
    status, body = _http(server, body=settings)
    assert status == 400 and says in body["error"]
    assert _grpc(server)["trace_level"] == ["TIMESTAMPS"]  # nothing changed


def test_without_an_endpoint_tracing_cannot_be_turned_on_and_an_unknown_model_is_not_found(
    small_model_dir: Path,
) -> None:
    with ServerThread(make_settings(small_model_dir, http_port=0, backend="torch")) as server:
        assert _grpc(server)["trace_level"] == ["OFF"]
        with pytest.raises(grpc.RpcError) as info:
            _grpc(server, trace_level=["TIMESTAMPS"])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--otlp-endpoint" in info.value.details()
        assert _grpc(server, trace_rate=["100"])["trace_rate"] == ["100"]  # kept, for nothing to trace yet
        with pytest.raises(grpc.RpcError) as info:
            _grpc(server, model="nope")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert _http(server, "/v2/models/nope/trace/setting")[0] == 404
