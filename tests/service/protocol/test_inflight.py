"""The in-flight budget on a real server: requests and answers held past --max-inflight-mb are
refused at once (RESOURCE_EXHAUSTED; HTTP 429 with Retry-After, 413 for a body that can never
fit), the gauge follows, and an HTTP client that never reads its answer holds its bytes until it
is cut off, while well-behaved clients beside it are answered."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ComputeGate, ManualClock, ServerThread, make_settings, until

C = 32
LEASE = 2 * 4 * 64 * C * 4  # a (4, 64, 32) request: its input and its answer


def _held(server: ServerThread) -> float:
    return server.registry.get_sample_value("mha_inflight_bytes") or 0.0


def _http_infer(server: ServerThread, body: bytes) -> tuple[int, dict, dict]:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/mha/infer"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _body(x: np.ndarray) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    return json.dumps({"inputs": [tensor]}).encode()


def test_requests_past_the_budget_are_refused_at_once_and_the_others_answered(small_model_dir: Path) -> None:
    gate = ComputeGate(held=("batch",))
    settings = make_settings(
        small_model_dir, backend="torch", max_inflight_mb=4.5 * LEASE / 2**20, http_port=0, max_batch_size=4
    )
    x = np.ones((4, 64, C), np.float32)
    with ServerThread(settings, compute_hook=gate) as server, MHAClient(server.url) as client:
        assert server.registry.get_sample_value("mha_inflight_budget_bytes") == int(4.5 * LEASE)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = [pool.submit(client.infer, x) for _ in range(4)]
            gate.arrived()  # the first computes (held), three queue behind it: 4 leases
            until(lambda: _held(server) == 4 * LEASE)
            with pytest.raises(InferenceError) as refused:
                client.infer(x, timeout=10)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "in flight" in str(refused.value) and "--max-inflight-mb" in str(refused.value)
            status, headers, doc = _http_infer(server, _body(x))
            assert (status, headers.get("Retry-After")) == (429, "1") and "in flight" in doc["error"]
            for _ in range(4):
                gate.permits.release()
            assert all(f.result(timeout=30).shape == x.shape for f in held)
        gate.held = ()  # from here on, computes run freely
        until(lambda: _held(server) == 0)
        with pytest.raises(InferenceError) as alone:  # more than the whole budget: it never fits
            client.infer(np.ones((64, 64, C), np.float32), timeout=10)
        assert alone.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "split the batch" in str(alone.value)
        status, _, doc = _http_infer(server, _body(np.ones((64, 64, C), np.float32)))
        assert status == 413 and "its body, parsed" in doc["error"]  # refused before its body was read
        assert client.infer(x).shape == x.shape and _held(server) == 0


def _never_reading(server: ServerThread, x: np.ndarray) -> socket.socket:
    """A connection that sends a request for `x`'s answer and never reads it."""
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(("127.0.0.1", server.http_port))
    body = _body(x)
    head = f"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    reader.sendall(head.encode() + body)
    return reader


BIG = np.ones((256, 64, C), np.float32)  # about 10 MB of JSON answer: more than the sockets hold


def test_an_http_client_that_never_reads_holds_its_bytes_while_others_are_answered(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, backend="torch", http_port=0)
    with ServerThread(settings) as server:
        reader = _never_reading(server, BIG)
        with MHAClient(server.url) as client:  # the others are answered meanwhile, after it (FIFO)
            small = np.ones((1, 8, C), np.float32)
            assert all(client.infer(small).shape == small.shape for _ in range(5))
        assert _http_infer(server, _body(small))[0] == 200
        assert _held(server) >= 2 * BIG.nbytes  # computed, and held while its answer waits to be read
        reader.close()  # the client leaves: its bytes go back
        until(lambda: _held(server) == 0)


def test_an_http_client_that_never_reads_is_cut_off_after_the_write_timeout(
    small_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(small_model_dir, backend="torch", http_port=0, http_write_timeout_s=0.2)
    with ServerThread(settings) as server:
        reader = _never_reading(server, BIG)
        until(lambda: _held(server) > 0)
        until(lambda: _held(server) == 0)  # cut off: its bytes go back though it is still connected
        assert any("did not read its answer within 0.2 s" in r.getMessage() for r in caplog.records)
        reader.settimeout(30)
        with contextlib.suppress(ConnectionError):
            while reader.recv(1 << 20):  # what was written before the cut, then the end
                pass
        reader.close()


def test_an_http_body_that_does_not_arrive_in_time_is_refused_408_and_its_bytes_go_back(
    small_model_dir: Path,
) -> None:
    """A client that sends a head announcing a large body, then drips it (or sends nothing more),
    held that body's share of the in-flight budget for as long as its connection lasted: a few
    such clients could starve every other. Past --http-read-timeout-s it is answered 408, its
    bytes go back, and the connection closes (the rest of its body is never read)."""
    settings = make_settings(small_model_dir, backend="torch", http_port=0, http_read_timeout_s=0.3)
    with ServerThread(settings) as server:
        dripping = socket.create_connection(("127.0.0.1", server.http_port))
        head = "POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n"
        dripping.sendall(head.encode() + b'{"inputs": [')
        until(lambda: _held(server) > 0)
        until(lambda: _held(server) == 0)  # refused: its bytes go back though it is still connected
        dripping.settimeout(30)
        answer = http.client.HTTPResponse(dripping)  # type: ignore[arg-type]  # reads the socket's file
        answer.begin()
        assert answer.status == 408 and answer.getheader("Connection") == "close"
        assert "did not arrive whole within 0.3 s (--http-read-timeout-s)" in json.loads(answer.read())["error"]
        dripping.close()
        x = np.ones((1, 8, C), np.float32)
        assert _http_infer(server, _body(x))[0] == 200  # a body sent in time is read as before


def test_answers_waiting_for_a_slow_reader_keep_no_batch_waiting_for_company(small_model_dir: Path) -> None:
    """A batch waits up to --max-queue-delay-ms for company only while requests that could join
    it are in the server. Answers computed for a stream that does not read are in flight until
    written, and can join nothing: with the batcher's clock stopped, a request beside them is
    answered at once (it would wait for the clock forever if they counted)."""
    clock = ManualClock()
    settings = make_settings(small_model_dir, backend="torch", max_queue_delay_ms=50.0)
    big = encode_infer_request(np.ones((64, 64, C), np.float32))  # 512 KiB answers: more than the windows hold
    with ServerThread(settings, clock=clock) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stream = stub.ModelStreamInfer(iter([big] * 16), timeout=60)  # and nothing read
        requests = server.engine.requests
        until(lambda: requests.count >= 4 and requests.uncomputed == 0)  # answers waiting to be written
        with MHAClient(server.url) as client:
            x = np.ones((1, 8, C), np.float32)
            assert client.infer(x, timeout=10).shape == x.shape
        assert requests.count - requests.uncomputed >= 4  # and the stream's answers still wait
        stream.cancel()
