"""The sequence entry (`mha_sequence`) under the hostile input the stateless entry takes in
test_fuzz.py: every malformed tensor as a sequence's first step, every malformed sequence
parameter, over gRPC and HTTP, and a property-based run of interleaved good and hostile steps
checked against the float64 reference over each sequence's whole prefix. Never INTERNAL, never a
wrong answer, and a refused step never changes a sequence's state."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
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
from tests.service.protocol.test_fuzz import CLIENT_MISTAKES, MALFORMED
from tests.support import ServerThread, make_settings

C, MAX_T = 32, 64
ENTRY = "mha_sequence"
STATE_CODES = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
IDS = itertools.count(1)


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    settings = make_settings(
        small_model_dir, backend="auto", max_sequences=64, max_request_rows=16, http_port=0, shared_memory="system"
    )
    with ServerThread(settings) as s:
        yield s


@pytest.fixture(scope="module")
def reference(small_model_dir: Path):  # type: ignore[no-untyped-def]
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    return lambda whole: attention_view(torch.from_numpy(whole), weights, config)


def _as_first_step(data: bytes, sequence_id: str) -> bytes:
    """A malformed request of test_fuzz.py, sent to the sequence entry as a sequence's start."""
    try:
        request = pb.ModelInferRequest.FromString(data)
    except Exception:  # bytes that are not a request stay what they are
        return data
    if request.model_name == "mha":
        request.model_name = ENTRY
    if not any(key in request.parameters for key in ("sequence_id", "sequence_start", "sequence_end")):
        request.parameters["sequence_id"].string_param = sequence_id
        request.parameters["sequence_start"].bool_param = True
    return request.SerializeToString()


def _refused(call: grpc.UnaryUnaryMultiCallable, data: bytes, metadata: tuple = ()) -> str | None:
    """None when refused as a client's mistake with a bounded message; else what happened."""
    try:
        call(data, timeout=10, metadata=metadata)
        return "OK"
    except grpc.RpcError as exc:
        if exc.code() not in CLIENT_MISTAKES | STATE_CODES or len(exc.details() or "") > 1000:
            return f"{exc.code().name}: {(exc.details() or '')[:200]}"
    return None


def _step(x: np.ndarray, sequence_id: str, offset: int, **parameters: object) -> pb.ModelInferRequest:
    request = encode_infer_request(x, model_name=ENTRY)
    request.parameters["sequence_id"].string_param = sequence_id
    request.parameters["sequence_start"].bool_param = offset == 0
    request.parameters["sequence_offset"].int64_param = offset
    for key, value in parameters.items():
        field = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    return request


def test_every_malformed_tensor_is_refused_as_a_first_step_and_leaves_no_sequence(
    call: grpc.UnaryUnaryMultiCallable, server: ServerThread
) -> None:
    wrong, ids = {}, []
    for name, data in MALFORMED.items():
        sequence_id = f"malformed-{next(IDS)}"
        ids.append(sequence_id)
        if (what := _refused(call, _as_first_step(data, sequence_id))) is not None:
            wrong[name] = what
    assert not wrong, wrong
    token = np.ones((1, 1, C), np.float32)
    for sequence_id in ids[::10]:  # a refused start created nothing: a step of it is not found
        with pytest.raises(grpc.RpcError) as info:
            call(_step(token, sequence_id, 1).SerializeToString(), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, (sequence_id, info.value.details())
    assert server.registry.get_sample_value("mha_sequences_active") == 0


def _bad_parameters() -> dict[str, tuple[pb.ModelInferRequest, tuple]]:
    x = np.ones((1, 2, C), np.float32)
    cases: dict[str, tuple[pb.ModelInferRequest, tuple]] = {}
    no_id = encode_infer_request(x, model_name=ENTRY)
    cases["no-sequence-id"] = (no_id, ())
    for label, value in (("double", 1.5), ("bool", True), ("zero", 0), ("negative", -1), ("empty", "")):
        request = encode_infer_request(x, model_name=ENTRY)
        field = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters["sequence_id"], field, value)
        request.parameters["sequence_start"].bool_param = True
        cases[f"id-{label}"] = (request, ())
    long_id = _step(x, "s" * 129, 0)
    cases["id-too-long"] = (long_id, ())
    for key, value in (("sequence_start", 1), ("sequence_start", "true"), ("sequence_end", 1.0)):
        request = _step(x, "params", 0)
        request.parameters[key].Clear()
        field = {int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
        cases[f"{key}-{type(value).__name__}"] = (request, ())
    for label, value in (("negative", -1), ("string", "0"), ("double", 0.0)):
        request = _step(x, "params", 0)
        request.parameters["sequence_offset"].Clear()
        field = {int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters["sequence_offset"], field, value)
        cases[f"offset-{label}"] = (request, ())
    cases["start-at-offset-3"] = (_step(x, "params", 0, sequence_offset=3), ())
    cases["unknown-sequence"] = (_step(x, "never-started", 4), ())
    cases["timeout-negative"] = (_step(x, "params", 0, timeout=-5), ())
    cases["timeout-string"] = (_step(x, "params", 0, timeout="soon"), ())
    cases["priority-1"] = (_step(x, "params", 0, priority=1), ())
    cases["header-differs"] = (_step(x, "params", 0), (("mha-sequence-id", "other"),))
    cases["header-alone"] = (encode_infer_request(x, model_name=ENTRY), (("mha-sequence-id", "params"),))
    twice = (("mha-sequence-id", "params"), ("mha-sequence-id", "other"))  # a balancer may hash on the second
    cases["header-twice-the-first-agreeing"] = (_step(x, "params", 0), twice)
    cases["too-long"] = (_step(np.ones((1, MAX_T + 1, C), np.float32), "params", 0), ())
    return cases


def test_every_malformed_sequence_parameter_is_refused_precisely(
    call: grpc.UnaryUnaryMultiCallable, server: ServerThread
) -> None:
    wrong = {}
    for name, (request, metadata) in _bad_parameters().items():
        if (what := _refused(call, request.SerializeToString(), metadata)) is not None:
            wrong[name] = what
    assert not wrong, wrong
    assert server.registry.get_sample_value("mha_sequences_active") == 0  # none of them started one


def _http_step(server: ServerThread, x: np.ndarray, sequence_id: str, offset: int, changed: dict | None = None) -> dict:
    """A step over HTTP (its parameters as `changed` says): the answer's JSON, or
    {"status": code, "error": message} when refused."""
    parameters = {"sequence_id": sequence_id, "sequence_start": offset == 0, "sequence_offset": offset}
    parameters |= changed or {}
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    body = json.dumps({"inputs": [tensor], "parameters": parameters}).encode()
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{ENTRY}/infer"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, **json.loads(exc.read())}


def test_malformed_sequence_parameters_over_http_answer_4xx_in_http_words(server: ServerThread) -> None:
    x = np.ones((1, 2, C), np.float32)
    cases = {
        "id-double": ({"sequence_id": 1.5}, 400),
        "id-zero": ({"sequence_id": 0}, 400),
        "id-lone-surrogate": ({"sequence_id": "a\ud800"}, 400),  # JSON carries it; no protocol can go on with it
        "start-string": ({"sequence_start": "yes"}, 400),
        "offset-negative": ({"sequence_offset": -2}, 400),
        "offset-string": ({"sequence_offset": "2"}, 400),
        "offset-object": ({"sequence_offset": {"a": 1}}, 400),
        "start-at-3": ({"sequence_offset": 3}, 400),
        "unknown": ({"sequence_start": False, "sequence_offset": 2}, 404),
    }
    wrong = {}
    for name, (parameters, status) in cases.items():
        answer = _http_step(server, x, f"http-{name}", 0, parameters)
        error = str(answer.get("error", ""))
        if answer.get("status") != status or not 0 < len(error) <= 1000 or "_param" in error:
            wrong[name] = answer
    assert not wrong, wrong


finite = st.floats(-4, 4, width=32)
HOSTILE = ("nan", "width", "offset", "datatype", "rows")


@st.composite
def step_plans(draw: st.DrawFn) -> list[tuple[int, str, int, bool]]:
    """Steps on 3 sequences: (which sequence, 'ok' or a hostile kind, tokens, over HTTP)."""
    kinds = st.sampled_from(("ok", "ok", "ok", *HOSTILE))
    step = st.tuples(st.integers(0, 2), kinds, st.integers(1, 6), st.booleans())
    return draw(st.lists(step, min_size=1, max_size=10))


def _hostile(kind: str, x: np.ndarray, sequence_id: str, offset: int) -> pb.ModelInferRequest:
    if kind == "nan":
        x = x.copy()
        x[0, -1, 0] = np.nan
    elif kind == "width":
        x = np.ones((1, x.shape[1], C + 1), np.float32)
    elif kind == "rows":
        x = np.ones((2, x.shape[1], C), np.float32)
    request = _step(x, sequence_id, offset + (7 if kind == "offset" else 0))
    request.parameters["sequence_start"].bool_param = offset == 0
    if kind == "datatype":
        request.inputs[0].datatype = "FP16"
    return request


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=step_plans(), seed=st.integers(0, 2**16))
def test_interleaved_good_and_hostile_steps_stay_exact(
    call: grpc.UnaryUnaryMultiCallable, server: ServerThread, reference, plan, seed: int
) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    run = next(IDS)
    prefixes = [np.zeros((1, 0, C), np.float32) for _ in range(3)]
    for which, kind, t, over_http in plan:
        prefix, sequence_id = prefixes[which], f"prop-{run}-{which}"
        if prefix.shape[1] + t > MAX_T or (kind == "rows" and not prefix.shape[1]):  # 2 rows: a fine start
            continue
        x = rng.uniform(-4, 4, (1, t, C)).astype(np.float32)
        offset = prefix.shape[1]
        if kind != "ok":
            request = _hostile(kind, x, sequence_id, offset)
            refused = _refused(call, request.SerializeToString())
            assert refused is None, (kind, refused)
            continue
        if over_http:
            answer = _http_step(server, x, sequence_id, offset)
            assert "error" not in answer, answer
            y = np.array(answer["outputs"][0]["data"], np.float32).reshape(x.shape)
            length = answer["parameters"]["sequence_length"]
        else:
            response = pb.ModelInferResponse.FromString(call(_step(x, sequence_id, offset).SerializeToString()))
            y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(x.shape)
            length = response.parameters["sequence_length"].int64_param
        prefixes[which] = whole = np.concatenate([prefix, x], axis=1)  # (1, P + t, C)
        assert length == whole.shape[1]
        error = relative_error(torch.from_numpy(y.copy()), reference(whole)[:, -t:])
        assert error < 1e-5, (which, kind, t, error)
