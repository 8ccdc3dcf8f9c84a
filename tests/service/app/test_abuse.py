"""Bytes that are not requests, broken streams and streams left open: precise statuses, counted,
logged in one line, and nothing else disturbed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.app.server import drain_and_stop
from service.proto import grpc_service_pb2 as pb
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ServerThread, make_settings

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
NOT_A_REQUEST = "the request is not a valid inference.ModelInferRequest"


def _good(i: int = 0) -> bytes:
    x = np.random.default_rng(i).standard_normal((1, 3, 32), dtype=np.float32)
    return encode_infer_request(x, request_id=str(i)).SerializeToString()


def _nested_groups(depth: int) -> bytes:
    return b"\x0b" * depth + b"\x0c" * depth  # field 1 as start-group / end-group tags


UNPARSABLE = {
    "random": bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)),
    "four-bytes": b"\xff\xff\xff\xff",
    "truncated": _good()[:-7],
    "bad-utf8-model-name": b"\x0a\x03\xff\xfe\xfd",  # field 1 (model_name), 3 bytes that are not UTF-8
    "length-overflow": b"\x0a\xff\xff\xff\xff\x0f",
    "nested-groups": _nested_groups(200),
}


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as s:
        yield s


def _count(server: ServerThread, method: str, code: str) -> float:
    return server.registry.get_sample_value("mha_requests_total", {"method": method, "code": code}) or 0.0


@pytest.mark.parametrize("data", UNPARSABLE.values(), ids=UNPARSABLE.keys())
def test_unparsable_bytes_are_invalid_argument_counted_and_logged_once(
    server: ServerThread, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    before = _count(server, "ModelInfer", "INVALID_ARGUMENT")
    with (
        grpc.insecure_channel(server.url) as channel,
        caplog.at_level(logging.INFO),
        pytest.raises(grpc.RpcError) as info,
    ):
        channel.unary_unary(INFER)(data, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and NOT_A_REQUEST in info.value.details()
    assert _count(server, "ModelInfer", "INVALID_ARGUMENT") == before + 1
    lines = [r for r in caplog.records if NOT_A_REQUEST in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None  # one line, no traceback
    assert lines[0].levelno == logging.INFO  # a client's mistake: no warning for on-call to chase


def test_a_corrupt_message_ends_the_stream_after_answering_what_came_before(server: ServerThread) -> None:
    messages = [_good(0), _good(1), _good(2), b"\xff\xff\xff\xff", _good(3), _good(4)]
    before = _count(server, "ModelStreamInfer", "INVALID_ARGUMENT")
    answered = []
    with grpc.insecure_channel(server.url) as channel:
        call = channel.stream_stream(STREAM)(iter(messages), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            for data in call:
                answered.append(pb.ModelStreamInferResponse.FromString(data).infer_response.id)
    assert sorted(answered) == ["0", "1", "2"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and NOT_A_REQUEST in info.value.details()
    assert _count(server, "ModelStreamInfer", "INVALID_ARGUMENT") == before + 1


def test_an_open_stream_ends_unavailable_on_drain_instead_of_holding_it(small_model_dir: Path) -> None:
    grace = 30.0
    release = threading.Event()
    with ServerThread(make_settings(small_model_dir, backend="torch", grace_s=grace)) as server:

        def requests() -> Iterator[bytes]:
            yield _good(0)
            yield _good(1)
            release.wait(60)  # the client keeps its side open

        with grpc.insecure_channel(server.url) as channel:
            call = channel.stream_stream(STREAM)(requests(), timeout=60)
            answered = [next(call), next(call)]
            assert server.running is not None
            server.call(drain_and_stop(server.running, grace), timeout=grace / 3)  # not held for the grace
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            release.set()
        server.running = None  # already stopped
    assert len(answered) == 2
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
