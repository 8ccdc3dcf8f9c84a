"""The id a call is logged under, over a real server's gRPC and HTTP ports: the request's own `id`
where the client sent one, else the `x-request-id` a proxy in front set (Envoy, Istio, nginx), else
one the server makes; a long one cut, as every client string."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.logs import RequestIdFilter
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ServerThread, make_settings, until

BAD = np.zeros((1, 2, 31), np.float32)  # C = 31 where the model takes 32: refused, and so logged at INFO


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, http_port=0)) as s:
        yield s


def _logged_ids(caplog: pytest.LogCaptureFixture, send: object, count: int = 1) -> list[str]:
    """The request ids of the `count` call lines logged for what `send()` sent (a line is
    written once the answer has gone: waited for)."""
    caplog.clear()
    caplog.handler.addFilter(RequestIdFilter())

    def lines() -> list[str]:
        return [r.request_id for r in caplog.records if r.name == "service.protocol.calls" and hasattr(r, "method")]

    with caplog.at_level(logging.INFO, logger="service.protocol.calls"):
        send()  # type: ignore[operator]
        until(lambda: len(lines()) >= count, timeout_s=10, what=f"{count} call lines are logged")
    return lines()


def _grpc(server: ServerThread, client_id: str, metadata: tuple[tuple[str, str], ...]) -> None:
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as refused:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(encode_infer_request(BAD, request_id=client_id), metadata=metadata, timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def _http(server: ServerThread, headers: dict[str, str], client_id: str = "") -> None:
    body: dict = {"inputs": [{"name": "x", "shape": list(BAD.shape), "datatype": "FP32", "data": BAD.ravel().tolist()}]}
    if client_id:
        body["id"] = client_id
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v2/models/mha/infer", json.dumps(body).encode(), headers, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400


@pytest.mark.parametrize(
    ("client_id", "metadata", "logged"),
    [
        ("", (("x-request-id", "envoy-1f3a"),), "envoy-1f3a"),  # a proxy's id
        ("client-7", (("x-request-id", "envoy-1f3a"),), "client-7"),  # the client's own id first
        ("", (("x-request-id", "x" * 5000),), "x" * 64),  # cut to 64 (gRPC sends printable ASCII only)
    ],
    ids=["proxy", "client-first", "hostile"],
)
def test_a_grpc_call_is_logged_under_its_clients_or_its_proxys_id(
    server: ServerThread, caplog: pytest.LogCaptureFixture, client_id: str, metadata: tuple, logged: str
) -> None:
    assert _logged_ids(caplog, lambda: _grpc(server, client_id, metadata)) == [logged]


def test_without_an_id_the_server_makes_one_per_call(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    ids = _logged_ids(caplog, lambda: [_grpc(server, "", ()) for _ in range(2)], count=2)
    assert len(ids) == 2 and len(set(ids)) == 2 and all(len(i) == 16 for i in ids), ids


def test_an_http_call_is_logged_under_its_clients_or_its_proxys_id(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    assert _logged_ids(caplog, lambda: _http(server, {"X-Request-ID": "nginx-9c2e"})) == ["nginx-9c2e"]
    assert _logged_ids(caplog, lambda: _http(server, {"X-Request-ID": "nginx-9c2e"}, "body-5")) == ["body-5"]
    assert _logged_ids(caplog, lambda: _http(server, {}, "y" * 300)) == ["y" * 64]
    (made,) = _logged_ids(caplog, lambda: _http(server, {}))
    assert made != "nginx-9c2e" and len(made) == 16
