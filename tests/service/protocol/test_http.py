"""The HTTP/REST endpoint's own behaviour in-process: statuses for every error, token, draining,
the binary-data framing. (tritonclient.http drives it end to end in tests/e2e.)"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.app.server import drain_and_stop
from tests.support import ServerThread, make_settings


def _call(port: int, path: str, body: bytes | None = None, headers: dict[str, str] | None = None):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0, max_queue_size=1)) as s:
        yield s


def _infer_json(x: np.ndarray, **extra: object) -> bytes:
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.tolist()}
    return json.dumps({"inputs": [tensor], **extra}).encode()


def _with(**fields: object) -> bytes:
    tensor = {"name": "x", "shape": [1, 1, 32], "datatype": "FP32", "data": [1.0] * 32}
    return json.dumps({"inputs": [{**tensor, **fields.pop("tensor", {})}], **fields}).encode()


BAD = {
    "not-json": (b"{nope", 400, "not valid JSON"),
    "inputs-twice": (  # Python's json read the second, Triton's rapidjson the first
        _with().replace(b'{"inputs": ', b'{"inputs": [], "inputs": ', 1),
        400,
        "the request gives the key 'inputs' twice in one object; send each key once",
    ),
    "shape-twice-in-an-input": (
        _with().replace(b'"shape": ', b'"shape": [1, 1, 31], "shape": ', 1),
        400,
        "gives the key 'shape' twice",
    ),
    "nested-too-deep": (b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    "parameters-a-list": (_with(parameters=[1]), 400, "the request's parameters must be a JSON object"),
    "id-an-object": (_with(id={"x": 1}), 400, "the request's id must be a JSON string, got dict"),
    "id-a-number": (_with(id=7), 400, "the request's id must be a JSON string, got int"),
    "outputs-not-objects": (_with(outputs=[5]), 400, "each requested output must be a JSON object"),
    "outputs-an-object": (_with(outputs={"a": 1}), 400, "outputs must be a JSON list"),
    "output-twice": (_with(outputs=[{"name": "y"}, {"name": "y"}]), 400, "output 'y' is requested 2 times"),
    "input-parameters-a-number": (_with(tensor={"parameters": 5}), 400, "an input's parameters must be a JSON"),
    "shape-over-64-bits": (_with(tensor={"shape": [1, 1, 1 << 70]}), 400, "shape must be a list of 64-bit integers"),
    "parameter-over-64-bits": (_with(parameters={"p": 1 << 70}), 400, "does not fit 64 bits"),
    "binary-size-a-bool": (_with(tensor={"parameters": {"binary_data_size": True}}), 400, "does not fit"),
    "no-object": (b"[1, 2]", 400, "JSON object"),
    "wrong-C": (_infer_json(np.zeros((1, 2, 31), np.float32)), 400, "expected C = 32"),
    "words-as-data": (
        json.dumps({"inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": ["a", "b"]}]}).encode(),
        400,
        "data must be JSON numbers, got strings",
    ),
    "numeric-strings": (_with(tensor={"data": ["1"] * 32}), 400, "data must be JSON numbers, got strings"),
    "booleans-among-numbers": (
        _with(tensor={"data": [[[True] + [1.0] * 31]]}),
        400,
        "data must be JSON numbers, got booleans",
    ),
    "nulls": (_with(tensor={"data": [None] * 32}), 400, "data must be JSON numbers, got nulls"),
    "integer-of-5000-digits": (  # before: 500, Python's int conversion refusing it inside json.loads
        _with(tensor={"data": "DIGITS"}).replace(b'"DIGITS"', b"[" + b"1" * 5000 + b"]"),
        400,
        "holds an integer of more than 4300 digits",
    ),
    "integer-beyond-float": (_with(tensor={"data": [10**400] + [1] * 31}), 400, "an integer too large for FP32"),
    "number-beyond-float32": (_with(tensor={"data": [1e39] + [1.0] * 31}), 400, "|x| > 3.4e38, is read as inf"),
    "ragged-data": (_with(tensor={"data": [[1.0] * 16, [1.0] * 15]}), 400, "numbers in equal-length lists"),
    "sequence": (
        _infer_json(np.zeros((1, 2, 32), np.float32), parameters={"sequence_id": 7}),
        404,
        "start it again with sequence_start",
    ),
    "object-sequence-id": (_with(parameters={"sequence_id": {"a": 1}}), 400, "is a JSON object; expected a string"),
    "array-parameter": (_with(parameters={"priority": [1]}), 400, "is a JSON array; expected a string"),
    "element-count": (_with(tensor={"data": [1.0] * 31}), 400, "data holds 31 values; shape [1, 1, 32] needs 32"),
    "flag-not-a-bool": (
        _with(parameters={"sequence_start": 1}),
        400,
        "must be a boolean (true or false), got an integer",
    ),
    "sequence-id-a-number": (
        _with(parameters={"sequence_id": 1.5}),
        400,
        "must be an integer or a string, got a number",
    ),
    "no-data": (
        json.dumps({"inputs": [{"name": "x", "shape": [1, 1, 32], "datatype": "FP32"}]}).encode(),
        400,
        "carries no data; expected binary data (binary_data_size) or data",
    ),
    "binary-too-short": (
        b'{"inputs": [{"name": "x", "shape": [1, 1, 32], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}',
        400,
        "does not fit the 0 bytes sent",
    ),
    "timeout-a-string": (_with(parameters={"timeout": "1s"}), 400, "'timeout' must be an integer microsecond count"),
}
GRPC_WORDS = re.compile(r"_param\b|_contents\b|\bcontents\.")  # each protocol names its own fields


@pytest.mark.parametrize(("body", "status", "says"), BAD.values(), ids=BAD.keys())
def test_client_mistakes_get_the_http_status_of_their_grpc_code(
    server: ServerThread, body: bytes, status: int, says: str
) -> None:
    assert server.http_port
    code, _, answer = _call(server.http_port, "/v2/models/mha/infer", body)
    error = json.loads(answer)["error"]
    assert code == status and says in error, error
    assert not GRPC_WORDS.search(error), error  # before: "contents.fp32_contents holds 31 values"


def test_a_body_over_the_message_limit_is_resource_exhausted(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, backend="torch", http_port=0, max_message_mb=1)
    with ServerThread(settings) as s:
        code, _, answer = _call(s.http_port, "/v2/models/mha/infer", b"x" * (2 << 20))
    assert code == 413 and "larger than this server's limit of 1 MiB" in json.loads(answer)["error"]


def test_binary_data_both_ways(server: ServerThread, small_model_dir: Path) -> None:
    x = np.random.default_rng(0).standard_normal((2, 5, 32), dtype=np.float32)
    head = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [2, 5, 32], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {"Inference-Header-Content-Length": str(len(head))}
    code, response_headers, body = _call(server.http_port, "/v2/models/mha/infer", head + x.tobytes(), headers)
    assert code == 200
    split = int(response_headers["Inference-Header-Content-Length"])
    doc = json.loads(body[:split])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes == len(body) - split
    y = np.frombuffer(body[split:], np.float32).reshape(x.shape)
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    assert relative_error(torch.from_numpy(y.copy()), attention_view(torch.from_numpy(x), weights, config)) < 1e-5
    code, _, answer = _call(server.http_port, "/v2/models/mha/infer", head + x.tobytes()[:-4], headers)
    assert code == 400 and "does not fit" in json.loads(answer)["error"]
    code, _, answer = _call(server.http_port, "/v2/models/mha/infer", head + x.tobytes() + bytes(4), headers)
    says = "4 bytes of binary data follow the inputs' binary_data_size (1280 bytes in all)"
    assert code == 400 and says in json.loads(answer)["error"]  # sizes and data disagree: never half-read


def test_a_json_answer_holds_exactly_the_binary_answers_values(server: ServerThread) -> None:
    """The same request answered as JSON and with the binary extension: each JSON number is the
    float32 of the binary answer widened to float64 (as json.dumps and Triton write it), so a
    client that keeps float64 reads the same values whichever way it asked; and a float32 cast of
    it is the float32 itself."""
    x = np.random.default_rng(3).standard_normal((1, 7, 32), dtype=np.float32)
    code, _, text = _call(server.http_port, "/v2/models/mha/infer", _infer_json(x))
    assert code == 200
    as_json = np.array(json.loads(text)["outputs"][0]["data"], dtype=np.float64)
    code, headers, body = _call(
        server.http_port, "/v2/models/mha/infer", _infer_json(x, parameters={"binary_data_output": True})
    )
    assert code == 200
    y = np.frombuffer(body[int(headers["Inference-Header-Content-Length"]) :], np.float32)
    assert np.array_equal(as_json, y.astype(np.float64)), "a JSON number other than the float32 answer"


@pytest.mark.parametrize("length", ["²", "1" * 5000])
def test_a_header_length_int_cannot_read_is_the_clients_mistake(server: ServerThread, length: str) -> None:
    """'²' is a digit to str.isdigit and not to int() (sent as UTF-8, as curl sends it); 5000
    digits are past the 4300 that int() converts (before: 500)."""
    body = _infer_json(np.zeros((1, 2, 32), np.float32))
    head = f"POST /v2/models/mha/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(head.encode() + f"Inference-Header-Content-Length: {length}\r\n\r\n".encode() + body)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 400") and b"must be a byte count" in answer, answer[:300]


@pytest.mark.parametrize(("value", "kind"), [("yes", "a string"), (1, "an integer")])
def test_binary_output_flags_are_booleans(server: ServerThread, value: object, kind: str) -> None:
    per_output = [{"name": "y", "parameters": {"binary_data": value}}]
    for parameters, outputs in (({"binary_data_output": value}, []), ({}, per_output)):
        body = _infer_json(np.zeros((1, 2, 32), np.float32), parameters=parameters, outputs=outputs)
        code, _, answer = _call(server.http_port, "/v2/models/mha/infer", body)
        key = next(iter(parameters)) if parameters else "binary_data"
        assert code == 400 and f"{key} must be a boolean (true or false), got {kind}" in json.loads(answer)["error"]


@pytest.mark.parametrize("path", ["/v2/models/mha/infer", "/v2/logging", "/v2/repository/index"])
def test_a_body_that_cannot_be_read_is_the_clients_mistake(server: ServerThread, path: str) -> None:
    """Whatever the route: bytes its Content-Encoding cannot decode are 400, and a body that
    decompresses past --max-message-mb (64 MiB here) is 413, never read whole."""
    gzip_header = {"Content-Encoding": "gzip"}
    code, _, answer = _call(server.http_port, path, b"\x1f\x8b not gzip at all", gzip_header)
    assert code == 400 and "the request body cannot be read" in json.loads(answer)["error"], answer
    bomb = gzip.compress(bytes(65 << 20), compresslevel=1)  # 65 MiB of zeros in about 64 KiB
    code, _, answer = _call(server.http_port, path, bomb, gzip_header)
    assert code == 413 and "larger than this server's limit of 64 MiB" in json.loads(answer)["error"], answer


def _raw_deflate(data: bytes) -> bytes:
    squeeze = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return squeeze.compress(data) + squeeze.flush()


ENCODED = {  # Content-Encoding: what makes the body
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,  # RFC 9110's deflate: zlib's format
    "Deflate": _raw_deflate,  # as some clients send it: raw, without zlib's header
}


@pytest.mark.parametrize("encoding", ENCODED)
@pytest.mark.parametrize("shape", [(2, 3, 32), (8, 64, 32)])  # one chunk as read, and several
def test_a_compressed_body_answers_as_the_plain_one(server: ServerThread, encoding: str, shape: tuple) -> None:
    x = np.random.default_rng(5).standard_normal(shape, dtype=np.float32)
    plain = _call(server.http_port, "/v2/models/mha/infer", _infer_json(x))
    body = ENCODED[encoding](_infer_json(x))
    packed = _call(server.http_port, "/v2/models/mha/infer", body, {"Content-Encoding": encoding})
    assert plain[0] == packed[0] == 200 and json.loads(plain[2])["outputs"] == json.loads(packed[2])["outputs"]


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip"])
def test_a_body_in_an_encoding_the_server_does_not_read_is_415(server: ServerThread, encoding: str) -> None:
    """Before: br and zstd answered 400 in plain text ("Please install `Brotli`"), and an encoding
    aiohttp did not know was read as plain bytes."""
    body = _infer_json(np.zeros((1, 2, 32), np.float32))
    code, headers, answer = _call(server.http_port, "/v2/models/mha/infer", body, {"Content-Encoding": encoding})
    assert code == 415 and headers["Content-Type"].startswith("application/json"), answer
    assert f"Content-Encoding {encoding!r} is not one this server reads" in json.loads(answer)["error"]


@pytest.mark.parametrize("cut", ["truncated", "trailing"])
def test_a_gzip_body_cut_short_or_followed_by_more_is_400(server: ServerThread, cut: str) -> None:
    packed = gzip.compress(_infer_json(np.zeros((1, 2, 32), np.float32)))
    body = packed[:-9] if cut == "truncated" else packed + b"more"
    code, _, answer = _call(server.http_port, "/v2/models/mha/infer", body, {"Content-Encoding": "gzip"})
    assert code == 400 and "cannot be read as gzip" in json.loads(answer)["error"], answer


def test_a_compressed_body_that_inflates_to_nothing_is_bounded_as_sent(small_model_dir: Path) -> None:
    """Empty deflate blocks (5 bytes each) inflate to nothing: a body of them was read without end."""
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0, max_message_mb=1)) as s:
        empty_blocks = b"\x00\x00\x00\xff\xff" * (2**20 // 5 + 1)  # raw deflate, just over 1 MiB
        code, _, answer = _call(s.http_port, "/v2/models/mha/infer", empty_blocks, {"Content-Encoding": "deflate"})
        assert code == 413 and "larger than this server's limit of 1 MiB" in json.loads(answer)["error"], answer


def test_a_body_without_length_is_held_in_the_budget_as_it_arrives(small_model_dir: Path) -> None:
    """A chunked body (no Content-Length) or one that decompresses is held in --max-inflight-mb as
    it is read: past the budget it is refused before the client has sent all of it, so that
    bodies of unknown length cannot take the process past its memory limit together."""
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0, max_inflight_mb=1.0)) as s:
        head = "POST /v2/models/mha/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"[" * 65536
        with socket.create_connection(("127.0.0.1", s.http_port), timeout=10) as sock:
            sock.sendall(head.encode() + b"%x\r\n" % len(chunk) + chunk + b"\r\n")  # not yet the last chunk
            answer = sock.recv(65536)  # before: the server waited for the rest of the body
            sock.sendall(b"0\r\n\r\n")  # the body ends: aiohttp's lingering read of it ends, nothing left pending
        assert answer.startswith(b"HTTP/1.1 413") and b"its body, parsed" in answer, answer[:300]
        x = np.zeros((1, 2, 32), np.float32)
        assert _call(s.http_port, "/v2/models/mha/infer", _infer_json(x))[0] == 200  # every lease given back


def test_a_body_that_grows_past_the_whole_budget_is_413_not_retry_later(small_model_dir: Path) -> None:
    """Held a MiB at a time, each step fits; the body as a whole does not, on an idle server: it
    can never be taken, so 413 (split it), not 429 (retry shortly). Before, each step was a lease
    of its own, and the one that crossed the budget was refused as if others held it."""
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0, max_inflight_mb=8.0)) as s:
        bomb = gzip.compress(bytes(16 << 20), compresslevel=1)  # 16 MiB of zeros in a few KiB
        code, headers, answer = _call(s.http_port, "/v2/models/mha/infer", bomb, {"Content-Encoding": "gzip"})
        error = json.loads(answer)["error"]
        assert code == 413 and "its body, parsed" in error and "whole in-flight budget of 8 MiB" in error, answer
        assert "Retry-After" not in headers
        x = np.zeros((1, 2, 32), np.float32)
        assert _call(s.http_port, "/v2/models/mha/infer", _infer_json(x))[0] == 200  # the grown lease given back


def test_the_token_applies_and_health_stays_open(small_model_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken")
    settings = make_settings(small_model_dir, backend="torch", http_port=0, auth_token_file=token)
    with ServerThread(settings) as s:
        body = _infer_json(np.zeros((1, 2, 32), np.float32))
        assert _call(s.http_port, "/v2/models/mha/infer", body)[0] == 401
        for wrong in ("t0ken-but-longer", "t0ke", "T0KEN"):  # a prefix of it, or it as a prefix
            code, _, answer = _call(s.http_port, "/v2/models/mha/infer", body, {"Authorization": f"Bearer {wrong}"})
            assert code == 401 and "Authorization: Bearer <token>" in json.loads(answer)["error"], (wrong, answer)
        assert _call(s.http_port, "/v2/models/mha/infer", body, {"Authorization": "Bearer t0ken"})[0] == 200
        assert _call(s.http_port, "/v2/health/ready")[0] == 200
        counted = s.registry.get_sample_value("mha_requests_total", {"method": "ModelInfer", "code": "UNAUTHENTICATED"})
    assert counted == 4


def test_draining_answers_503(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, backend="torch", http_port=0)
    with ServerThread(settings) as s:
        assert s.running is not None
        s.running.engine.life.start_draining()
        code, _, answer = _call(s.http_port, "/v2/models/mha/infer", _infer_json(np.zeros((1, 2, 32), np.float32)))
        ready = _call(s.http_port, "/v2/health/ready")[0]
        s.call(drain_and_stop(s.running, 1.0))
        s.running = None
    assert code == 503 and "draining" in json.loads(answer)["error"]
    assert ready == 503


def test_a_sequence_over_http(server: ServerThread, small_model_dir: Path) -> None:
    """Triton's sequence parameters in the JSON request: a prefix, then single tokens, each answer the
    last rows of the model over the whole prefix; the end frees the sequence."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    tokens = np.random.default_rng(7).standard_normal((1, 9, 32), dtype=np.float32)
    chunks = [(0, 5), (5, 6), (6, 7), (7, 9)]
    port, headers = server.http_port, {"mha-sequence-id": "http-seq"}
    stale = {"sequence_id": "http-seq", "sequence_offset": 1}
    for i, (start, end) in enumerate(chunks):
        if i == 1:  # the client believes in another state: 409, and nothing changes
            code, _, answer = _call(
                port, "/v2/models/mha/infer", _infer_json(tokens[:, 5:6], parameters=stale), headers
            )
            assert code == 409 and "holds 5 tokens" in json.loads(answer)["error"], answer
        flags = {"sequence_id": "http-seq", "sequence_start": i == 0, "sequence_end": i == len(chunks) - 1}
        flags["sequence_offset"] = start
        code, _, answer = _call(
            port, "/v2/models/mha/infer", _infer_json(tokens[:, start:end], parameters=flags), headers
        )
        assert code == 200, answer
        assert json.loads(answer)["parameters"]["sequence_length"] == end
        y = np.array(json.loads(answer)["outputs"][0]["data"], np.float32).reshape(1, end - start, 32)
        reference = attention_view(torch.from_numpy(tokens[:, :end]), weights, config)[:, start:]
        assert relative_error(torch.from_numpy(y), reference) < 1e-5
    code, _, answer = _call(
        server.http_port,
        "/v2/models/mha/infer",
        _infer_json(tokens[:, :1], parameters={"sequence_id": "http-seq"}),
    )
    assert code == 404 and "ended (sequence_end)" in json.loads(answer)["error"]


def test_the_timeout_parameter_bounds_the_wait_and_priority_outside_the_levels_is_refused(
    server: ServerThread, small_model_dir: Path
) -> None:
    """Triton's `timeout` (microseconds) bounds a request with no deadline of its own (HTTP has
    none): passed before the compute, it is DEADLINE_EXCEEDED (504), for a stateless request (its
    queue timeout) and a decode step alike, and the step leaves its sequence as it was. `priority`
    outside the model's levels (one here) is refused."""
    port, x = server.http_port, np.ones((1, 2, 32), np.float32)
    path = "/v2/models/mha/infer"
    assert _call(port, path, _infer_json(x, parameters={"timeout": 60_000_000}))[0] == 200
    code, _, answer = _call(port, path, _infer_json(x, parameters={"timeout": 1}))
    assert code == 504 and "queue timeout passed" in json.loads(answer)["error"], answer
    code, _, answer = _call(port, path, _infer_json(x, parameters={"priority": 2}))
    assert code == 400 and "priority levels 1 (1 the highest)" in json.loads(answer)["error"], answer
    assert _call(port, path, _infer_json(x, parameters={"priority": 0}))[0] == 200
    assert _call(port, path, _infer_json(x, parameters={"priority": 1}))[0] == 200
    start = {"sequence_id": "timed", "sequence_start": True}
    assert _call(port, path, _infer_json(x, parameters=start))[0] == 200
    late = {"sequence_id": "timed", "sequence_offset": 2, "timeout": 1}
    code, _, answer = _call(port, path, _infer_json(x[:, :1], parameters=late))
    assert code == 504, answer
    code, _, answer = _call(
        port, path, _infer_json(x[:, :1], parameters={"sequence_id": "timed", "sequence_offset": 2})
    )
    assert code == 200 and json.loads(answer)["parameters"]["sequence_length"] == 3  # the late step never counted


def test_a_client_that_leaves_while_sending_is_cancelled_not_a_server_fault(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """Content-Length 1000, 12 bytes sent, connection closed: CANCELLED, no ERROR, no traceback."""
    import socket

    get = server.registry.get_sample_value
    before = {c: get("mha_requests_total", {"method": "ModelInfer", "code": c}) or 0 for c in ("INTERNAL", "CANCELLED")}
    head = b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000"
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(head + b"\r\n\r\n" + b'{"inputs": [')
    deadline = time.monotonic() + 10
    while (get("mha_requests_total", {"method": "ModelInfer", "code": "CANCELLED"}) or 0) == before["CANCELLED"]:
        assert time.monotonic() < deadline, "the departure was never counted"
        time.sleep(0.02)
    assert (get("mha_requests_total", {"method": "ModelInfer", "code": "INTERNAL"}) or 0) == before["INTERNAL"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    ("method", "path", "code", "expected"),
    [
        ("GET", "/v2/nowhere", 404, "no route '/v2/nowhere'; the routes are GET /v2"),
        ("DELETE", "/v2/models/mha/infer", 405, "'DELETE' is not accepted on '/v2/models/mha/infer': use POST"),
        ("GET", "/v2/models/mha/infer", 405, "use POST"),
        ("GET", "/" + "a" * 100_000, 400, "the request could not be read as HTTP/1.1"),
    ],
)
def test_what_no_route_takes_answers_json_and_logs_no_error(
    server: ServerThread, caplog: pytest.LogCaptureFixture, method: str, path: str, code: int, expected: str
) -> None:
    """An unknown path, a method its path does not take: the documented {"error": ...} JSON; a
    request line aiohttp refuses (100,000 characters): its 400. One INFO line each, no ERROR and
    no traceback."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", method=method)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == code
    if code == 400:
        error = caplog.records[-1].getMessage()
        assert caplog.records[-1].levelno == logging.INFO
    else:
        assert info.value.headers["Content-Type"].startswith("application/json")
        error = json.loads(info.value.read())["error"]
    assert expected in error and len(error) < 600, error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records
    ]


def _with_headers(port: int, body: bytes, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """POST an inference with `headers` as given, a name repeated if it is listed twice."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("POST", "/v2/models/mha/infer")
        for name, value in [*headers, ("Content-Length", str(len(body)))]:
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_header_sent_twice_with_two_values_is_refused_and_with_one_served(server: ServerThread) -> None:
    """A balancer may read the last copy of a header, or every copy joined, where aiohttp gives the
    first: two copies that differ are refused, with the header named; two that agree are one."""
    x = np.ones((1, 1, 32), np.float32)
    head = json.dumps({"inputs": [{"name": "x", "shape": [1, 1, 32], "datatype": "FP32", "parameters": {}}]})
    head = head.replace('"parameters": {}', '"parameters": {"binary_data_size": 128}').encode()
    binary = head + x.tobytes()
    length = "Inference-Header-Content-Length"
    code, answer = _with_headers(server.http_port, binary, [(length, str(len(head))), (length, str(len(head) + 4))])
    assert code == 400 and f"the {length} header is sent 2 times with different values" in answer["error"], answer
    code, answer = _with_headers(server.http_port, binary, [(length, str(len(head)))] * 2)
    assert code == 200, answer
    step = _infer_json(x, parameters={"sequence_id": "twice", "sequence_start": True})
    ids = [("mha-sequence-id", "twice"), ("mha-sequence-id", "other")]
    code, answer = _with_headers(server.http_port, step, ids)
    assert code == 400 and "the mha-sequence-id header is sent 2 times" in answer["error"], answer
    assert "'twice', 'other'" in answer["error"]
