"""Hostile and careless input against a real server: a table of 150+ malformed requests and a
property-based fuzz of ModelInfer against the float64 reference. Never INTERNAL or UNKNOWN,
never a wrong answer, messages of bounded size, and the server correct afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.proto import grpc_service_pb2 as pb
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ServerThread, make_settings

C, MAX_T = 32, 64
CLIENT_MISTAKES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="auto", max_request_rows=16, shared_memory="system")) as s:
        yield s


def _request(
    shape: list[int], datatype: str = "FP32", name: str = "x", nbytes: int | None = None, **fields: object
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=str(fields.get("model", "mha")), model_version=str(fields.get("version", ""))
    )
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    count = int(np.prod(shape)) if shape and min(shape) > 0 and int(np.prod(shape)) < 1 << 22 else 0
    request.raw_input_contents.append(b"\0" * (nbytes if nbytes is not None else count * 4))
    return request


def _malformed() -> dict[str, bytes]:
    cases: dict[str, pb.ModelInferRequest | bytes] = {}
    for rank in (0, 1, 2, 4, 5):  # shapes
        cases[f"rank{rank}"] = _request([2] * (rank - 1) + [C] if rank else [])
    cases["rank100000"] = _request([1] * 99_999 + [C])  # its message once held every dim: 300 KB of trailer
    for b, t, c in [(1, 4, c) for c in (0, 1, 31, 33, 64, -32)] + [(b, 4, C) for b in (0, -1, 17, 1 << 40)]:
        cases[f"shape{b},{t},{c}"] = _request([b, t, c])
    for t in (0, -1, MAX_T + 1, 1 << 31, -(1 << 62)):
        cases[f"T{t}"] = _request([1, t, C])
    datatypes = ["FP16", "FP64", "BF16", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "fp32", "", "F" * 5000]
    for dt in datatypes:  # datatypes
        cases[f"dt-{dt[:8]}"] = _request([1, 4, C], datatype=dt)
    for delta in (-4096, -5, -4, -1, 1, 3, 4, 512):  # raw byte counts
        cases[f"bytes{delta:+d}"] = _request([1, 4, C], nbytes=4 * 4 * C + delta)
    for n in (0, 1, 4 * C - 1, 4 * C + 1, 10 * 4 * C):  # typed counts
        r = pb.ModelInferRequest(model_name="mha")
        r.inputs.add(name="x", datatype="FP32", shape=[1, 4, C]).contents.fp32_contents.extend([0.5] * n)
        cases[f"fp32-count{n}"] = r
    for kind in ("bool", "int", "int64", "uint", "uint64", "fp64", "bytes"):  # typed contents of another kind
        r = pb.ModelInferRequest(model_name="mha")
        contents = r.inputs.add(name="x", datatype="FP32", shape=[1, 1, 2]).contents
        getattr(contents, f"{kind}_contents").extend([b"\1", b"\2"] if kind == "bytes" else [1, 0])
        cases[f"typed-{kind}"] = r
    both = _request([1, 1, C])
    both.inputs[0].contents.fp32_contents.extend([0.0] * C)
    cases["raw-and-typed"] = both
    two_raw = _request([1, 1, C])
    two_raw.raw_input_contents.append(b"\0" * 4 * C)
    cases["two-raw"] = two_raw
    no_data = pb.ModelInferRequest(model_name="mha")
    no_data.inputs.add(name="x", datatype="FP32", shape=[1, 1, C])
    cases["no-data"] = no_data
    cases["no-inputs"] = pb.ModelInferRequest(model_name="mha")
    for n in (2, 5, 300):
        r = _request([1, 1, C])
        for i in range(1, n):
            r.inputs.add(name=f"x{i}" * 50, datatype="FP32", shape=[1, 1, C])
        cases[f"inputs{n}"] = r
    strings = ["", "MHA", "mha ", "mha\0", "m" * 100_000, "\u00e9\u4e2d\U0001f600", "../../etc/passwd", "%s%n{}"]
    for i, s in enumerate(strings):  # client strings
        cases[f"model{i}"] = _request([1, 1, C], model=s) if s else _request([1, 1, C], model="")
        cases[f"version{i}"] = _request([1, 1, C], version=s or "0")
        cases[f"input{i}"] = _request([1, 1, C], name=s)
        r = _request([1, 1, C])
        r.outputs.add(name=s)
        cases[f"output{i}"] = r
    for key in ("sequence_id", "sequence_start", "sequence_end"):  # unsupported protocol features
        r = _request([1, 1, C])
        r.parameters[key].int64_param = 1
        cases[f"param-{key}"] = r
    for key in ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"):
        r = _request([1, 1, C])
        r.inputs[0].parameters[key].string_param = "region"
        cases[f"in-param-{key}"] = r
        r = _request([1, 1, C])
        r.outputs.add(name="y").parameters[key].string_param = "region"
        cases[f"out-param-{key}"] = r
    r = _request([1, 1, C])
    r.outputs.add(name="y").parameters["classification"].int64_param = 3
    cases["classification"] = r
    nan = encode_infer_request(np.full((1, 2, C), np.nan, np.float32))
    cases["nan"], cases["inf"] = nan, encode_infer_request(np.full((1, 2, C), -np.inf, np.float32))
    good = encode_infer_request(np.ones((1, 3, C), np.float32)).SerializeToString()
    rng = np.random.default_rng(0)
    for i in range(40):  # bytes that are not a request
        cases[f"random{i}"] = bytes(rng.integers(0, 256, int(rng.integers(1, 400)), dtype=np.uint8))
    for cut in range(1, len(good), max(1, len(good) // 30)):
        cases[f"truncated{cut}"] = good[:cut]
    return {k: v if isinstance(v, bytes) else v.SerializeToString() for k, v in cases.items()}


MALFORMED = _malformed()


def _reference(model_dir: Path, x: np.ndarray) -> torch.Tensor:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    return attention_view(torch.from_numpy(x), weights, config)


def _still_correct(call: grpc.UnaryUnaryMultiCallable, model_dir: Path) -> None:
    x = np.random.default_rng(5).standard_normal((2, 9, C), dtype=np.float32)
    response = pb.ModelInferResponse.FromString(call(encode_infer_request(x).SerializeToString(), timeout=10))
    y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(x.shape)
    assert relative_error(torch.from_numpy(y.copy()), _reference(model_dir, x)) < 1e-5


def test_every_malformed_request_is_a_precise_client_error(
    call: grpc.UnaryUnaryMultiCallable, small_model_dir: Path
) -> None:
    wrong = {}
    for name, data in MALFORMED.items():
        try:
            call(data, timeout=10)
            wrong[name] = "OK"
        except grpc.RpcError as exc:
            if exc.code() not in CLIENT_MISTAKES or len(exc.details() or "") > 1000:
                wrong[name] = f"{exc.code().name}: {(exc.details() or '')[:200]}"
    assert not wrong, wrong
    _still_correct(call, small_model_dir)


shapes = st.lists(st.integers(-2, MAX_T + 2), min_size=0, max_size=4)
moderate = st.floats(-8, 8, width=32)
anything = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def infer_requests(draw: st.DrawFn) -> tuple[bytes, np.ndarray | None]:
    """A request and, when it is well-formed with moderate values, its input for the reference."""
    if draw(st.booleans()):  # well-formed shape
        b, t = draw(st.integers(1, 4)), draw(st.integers(1, MAX_T))
        values = draw(
            st.lists(st.one_of(moderate, anything) if draw(st.booleans()) else moderate, min_size=1, max_size=8)
        )
        x = np.resize(np.array(values, np.float32), (b, t, C))  # (B, T, C)
        request = encode_infer_request(x, model_name=draw(st.sampled_from(["mha", "mha", "bert"])))
        checkable = request.model_name == "mha" and bool(np.all(np.abs(x) <= 8))
        return request.SerializeToString(), x if checkable else None
    shape = draw(shapes)
    request = _request(shape, datatype=draw(st.sampled_from(["FP32", "FP32", "FP16", "INT8"])))
    request.raw_input_contents[0] = draw(st.binary(max_size=4 * C * 4))
    data = request.SerializeToString()
    if draw(st.booleans()):  # flip some bytes of the wire format
        position = draw(st.integers(0, max(0, len(data) - 1)))
        data = data[:position] + draw(st.binary(min_size=1, max_size=8)) + data[position + 1 :]
    return data, None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=infer_requests())
def test_fuzzed_requests_are_answered_correctly_or_refused_precisely(
    call: grpc.UnaryUnaryMultiCallable, small_model_dir: Path, case: tuple[bytes, np.ndarray | None]
) -> None:
    data, x = case
    try:
        response = pb.ModelInferResponse.FromString(call(data, timeout=10))
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_MISTAKES, (exc.code(), exc.details())
        assert x is None, f"a well-formed request was refused: {exc.details()}"
        return
    if x is not None:
        y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(x.shape)
        assert relative_error(torch.from_numpy(y.copy()), _reference(small_model_dir, x)) < 1e-5
