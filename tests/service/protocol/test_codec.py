"""The codecs and the neutral request: round trips and every request check, as pure functions.
A gRPC message and an HTTP body decode into the same InferRequest, and each protocol's
refusals name what its client wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from export.layout import ModelFiles
from model import MHAConfig
from service.engine.served import ModelIdentity, ServedModel
from service.errors import InvalidInput, ModelNotFound, quote
from service.proto import grpc_service_pb2 as pb
from service.protocol.grpc_codec import (
    decode_infer_response,
    encode_infer_request,
    request_from_proto,
    request_to_proto,
    response_to_proto,
)
from service.protocol.http_codec import request_from_json
from service.protocol.inference import answered, decode_input, sequence_control

SPEC = ServedModel(
    ModelIdentity("mha", "1", "mha_sequence"),
    MHAConfig(d_model=8, n_head=2, max_seq_len=16),
    ModelFiles(Path("m")),
    4,
    1.0,
    "0" * 64,
    True,
)


def decode_infer_request(request: pb.ModelInferRequest, model: ServedModel) -> np.ndarray:
    return decode_input(request_from_proto(request), model)


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


def test_raw_round_trip_without_copy() -> None:
    x = _x(2, 5, 8)
    request = encode_infer_request(x, request_id="abc")
    decoded = decode_infer_request(request, SPEC)
    assert np.array_equal(decoded, x)
    assert not decoded.flags.writeable  # a view of the request bytes, not a copy
    response = response_to_proto(answered(request_from_proto(request), SPEC, decoded, "torch-cpu"))
    assert response.id == "abc" and response.model_version == "1"
    assert response.parameters["backend"].string_param == "torch-cpu"
    assert len(response.raw_output_contents) == 1 and not response.outputs[0].HasField("contents")
    assert np.array_equal(decode_infer_response(response), x)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_the_client_refuses_complex_input_the_cast_would_halve(dtype: type) -> None:
    """np.ascontiguousarray(x, float32) of a complex array keeps the real parts, with a warning."""
    with pytest.raises(TypeError, match="expected real numbers"):
        encode_infer_request(np.full((1, 2, 4), 1 + 2j, dtype=dtype))
    assert encode_infer_request(np.ones((1, 2, 4), dtype=np.int64)).inputs[0].shape == [1, 2, 4]


def test_typed_fp32_contents_accepted() -> None:
    x = _x(1, 3, 8)
    request = pb.ModelInferRequest(model_name="mha")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 3, 8])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    assert np.array_equal(decode_infer_request(request, SPEC), x)


def _request(
    shape: list[int], datatype: str = "FP32", name: str = "x", nbytes: int | None = None
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mha")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    count = int(np.prod(shape)) if shape and min(shape) > 0 else 0
    request.raw_input_contents.append(b"\0" * (nbytes if nbytes is not None else count * 4))
    return request


BAD = [
    (_request([2, 8]), "has rank 2; expected rank 3"),
    (_request([1, 2, 3, 8]), "has rank 4; expected rank 3"),
    (_request([1, 4, 7]), r"C = 7; expected C = 8"),
    (_request([1, 0, 8]), r"T = 0; expected T >= 1"),
    (_request([1, 17, 8]), r"T = 17 exceeds max_seq_len 16"),
    (_request([0, 4, 8]), r"B = 0; expected B >= 1"),
    (_request([5, 4, 8]), r"B = 5 exceeds this server's limit of 4 rows"),
    (_request([1, 4, 8], datatype="FP16"), r"datatype 'FP16'; expected 'FP32'"),
    (_request([1, 4, 8], name="input"), r"unknown input 'input'; the model's input is 'x'"),
    (_request([1, 4, 8], nbytes=100), r"holds 100 bytes; shape \[1, 4, 8\] of FP32 needs 128 bytes"),
]


@pytest.mark.parametrize(("request_", "message"), BAD, ids=[m for _, m in BAD])
def test_invalid_requests(request_: pb.ModelInferRequest, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode_infer_request(request_, SPEC)


def test_structural_mistakes() -> None:
    two_inputs = _request([1, 4, 8])
    two_inputs.inputs.add(name="mask", datatype="BOOL", shape=[1, 4])
    with pytest.raises(InvalidInput, match=r"expected exactly 1 input tensor 'x', got 2"):
        decode_infer_request(two_inputs, SPEC)
    no_data = pb.ModelInferRequest(model_name="mha")
    no_data.inputs.add(name="x", datatype="FP32", shape=[1, 4, 8])
    with pytest.raises(InvalidInput, match="carries no data"):
        decode_infer_request(no_data, SPEC)
    both = _request([1, 4, 8])
    both.inputs[0].contents.fp32_contents.extend([0.0] * 32)
    with pytest.raises(InvalidInput, match=r"both raw_input_contents and contents\.fp32_contents"):
        decode_infer_request(both, SPEC)
    extra_raw = _request([1, 4, 8])
    extra_raw.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match="2 raw_input_contents entries for 1 input"):
        decode_infer_request(extra_raw, SPEC)
    short_typed = pb.ModelInferRequest(model_name="mha")
    short_typed.inputs.add(name="x", datatype="FP32", shape=[1, 4, 8]).contents.fp32_contents.extend([0.0] * 5)
    with pytest.raises(InvalidInput, match=r"holds 5 values; shape \[1, 4, 8\] needs 32"):
        decode_infer_request(short_typed, SPEC)
    wrong_output = _request([1, 4, 8])
    wrong_output.outputs.add(name="logits")
    with pytest.raises(InvalidInput, match="unknown requested output 'logits'"):
        decode_infer_request(wrong_output, SPEC)
    twice = _request([1, 4, 8])
    twice.outputs.add(name="y")
    twice.outputs.add(name="y")
    with pytest.raises(InvalidInput, match="output 'y' is requested 2 times; request it once"):
        decode_infer_request(twice, SPEC)


def test_unknown_model() -> None:
    """The one name check every model-scoped call makes (Answers.infer for inferences); versions
    are checked by the versions loaded (tests/service/engine/test_versions.py)."""
    with pytest.raises(ModelNotFound, match="unknown model 'gpt'; this server serves 'mha' and 'mha_sequence'"):
        SPEC.identity.check("gpt")
    assert SPEC.identity.check("mha_sequence") == "mha_sequence"


def test_attention_memory_budget_per_request() -> None:
    from dataclasses import replace

    tight = replace(SPEC, max_attention_mb=0.005)  # 2 heads: (2, 16) needs 0.0039 MiB, (4, 16) 0.0078
    assert decode_infer_request(encode_infer_request(_x(2, 16, 8)), tight).shape == (2, 16, 8)
    with pytest.raises(InvalidInput, match=r"attention needs 0 MiB \(B x 2 heads x T x T x 4 bytes\)"):
        decode_infer_request(encode_infer_request(_x(4, 16, 8)), tight)


def test_a_json_body_and_a_grpc_message_decode_to_the_same_request() -> None:
    x = _x(1, 3, 8)
    message = encode_infer_request(x, request_id="same")
    message.parameters["sequence_id"].string_param = "s"
    message.parameters["sequence_start"].bool_param = True
    message.parameters["sequence_offset"].int64_param = 0
    parameters = {"sequence_id": "s", "sequence_start": True, "sequence_offset": 0}
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 3, 8], "parameters": {"binary_data_size": x.nbytes}}
    head = json.dumps({"id": "same", "inputs": [tensor], "parameters": parameters}).encode()
    binary, _ = request_from_json(head + x.tobytes(), len(head), "mha", "")
    typed = {"name": "x", "datatype": "FP32", "shape": [1, 3, 8], "data": x.tolist()}
    listed, _ = request_from_json(
        json.dumps({"id": "same", "inputs": [typed], "parameters": parameters}).encode(), None, "mha", ""
    )
    from_grpc = request_from_proto(message)
    for request in (binary, listed, from_grpc):
        assert np.array_equal(decode_input(request, SPEC), x)
        assert sequence_control(request) == sequence_control(from_grpc)
        assert request.parameters == from_grpc.parameters
    again = request_from_proto(request_to_proto(listed))  # as a worker hands it over
    assert np.array_equal(decode_input(again, SPEC), x) and again.parameters == from_grpc.parameters


def test_each_protocol_names_its_own_fields_in_a_refusal() -> None:
    short = _request([1, 4, 8], nbytes=100)
    with pytest.raises(InvalidInput, match=r"^raw_input_contents holds 100 bytes"):
        decode_infer_request(short, SPEC)
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 4, 8], "parameters": {"binary_data_size": 100}}
    head = json.dumps({"inputs": [tensor]}).encode()
    request, _ = request_from_json(head + bytes(100), len(head), "mha", "")
    with pytest.raises(InvalidInput, match=r"^binary data \(binary_data_size\) holds 100 bytes"):
        decode_input(request, SPEC)
    listed, _ = request_from_json(
        json.dumps({"inputs": [{**tensor, "parameters": {}, "data": [1.0] * 5}]}).encode(), None, "mha", ""
    )
    with pytest.raises(InvalidInput, match=r"^data holds 5 values"):
        decode_input(listed, SPEC)
    both = {**tensor, "parameters": {"binary_data_size": 128}, "data": [0.0] * 32}
    head = json.dumps({"inputs": [both]}).encode()
    with pytest.raises(InvalidInput, match="both binary_data_size and data"):
        request_from_json(head + bytes(128), len(head), "mha", "")


SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())  # st.text drops them


@settings(max_examples=200, deadline=None)
@given(sequence_id=st.lists(st.one_of(st.characters(), SURROGATES), min_size=1, max_size=8).map("".join))
def test_a_sequence_id_the_checks_accept_every_protocol_can_carry(sequence_id: str) -> None:
    """A JSON body can escape any code point, lone surrogates too: an id is refused as the
    client's mistake, or it goes on to another worker (gRPC's message) and back unchanged."""
    parameters = {"sequence_id": sequence_id, "sequence_start": True}
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 1, 8], "data": [0.0] * 8}
    body = json.dumps({"inputs": [tensor], "parameters": parameters}).encode()
    sent = json.loads(json.dumps(sequence_id))  # what JSON carries: escaped pairs are one character
    try:
        request, _ = request_from_json(body, None, "mha", "")
    except InvalidInput as exc:
        assert "lone surrogate" in str(exc)
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in sent)
        return
    control = sequence_control(request)
    assert control is not None and control.id == sent
    handed = pb.ModelInferRequest.FromString(request_to_proto(request).SerializeToString())
    assert sequence_control(request_from_proto(handed)) == control


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
    max_leaves=12,
)


def _leaves(value: object) -> list[object]:
    return [leaf for item in value for leaf in _leaves(item)] if isinstance(value, list) else [value]


@settings(max_examples=300, deadline=None)
@given(data=JSON_VALUES)
def test_json_data_is_read_as_its_numbers_or_refused_as_the_clients_mistake(data: object) -> None:
    """Whatever JSON `data` holds, the codec reads exactly its numbers or refuses it with
    InvalidInput: never a boolean or a numeric string read as a number, never another error."""
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 1, 1], "data": data}
    body = json.dumps({"inputs": [tensor]}).encode()
    leaves = _leaves(data)
    try:
        request, _ = request_from_json(body, None, "mha", "")
    except InvalidInput:
        numbers = all(type(v) in (int, float) for v in leaves)
        assert not numbers or any(type(v) is int and abs(v) > 1e308 for v in leaves) or not _equal_lengths(data)
        return
    assert all(type(v) in (int, float) for v in leaves)
    with np.errstate(over="ignore"):
        assert np.array_equal(request.inputs[0].values, np.asarray(leaves, dtype=np.float32))


def _equal_lengths(value: object) -> bool:
    """Whether nested lists form a rectangular array (numpy reads nothing else)."""
    try:
        np.asarray(value, dtype=np.float64)
    except (ValueError, OverflowError):
        return False
    return True


PLACES = ("the request", "an input", "the parameters")


@settings(max_examples=200, deadline=None)
@given(where=st.sampled_from(PLACES), key=st.text(min_size=1, max_size=12), first=JSON_VALUES, second=JSON_VALUES)
@example(where="the request", key="inputs", first=None, second=None)  # a key the object already holds
@example(where="an input", key="shape", first=1, second=2)
def test_a_key_given_twice_in_one_object_is_refused_wherever_it_stands(
    where: str, key: str, first: object, second: object
) -> None:
    """JSON parsers disagree on a key given twice (Python's keeps the last, Triton's rapidjson
    the first): the body is refused with the key named, never read one way or the other. The
    same body with the key once is not refused for it, unless the object already holds that key."""
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 1, 1], "data": [0.5]}
    twice = json.dumps(key) + ": " + json.dumps(first) + ", " + json.dumps(key) + ": " + json.dumps(second)
    body = json.dumps({"inputs": [tensor], "parameters": {}})
    opening = {"the request": body.index("{"), "an input": body.index('{"name"'), "the parameters": body.rindex("{")}
    at = opening[where] + 1
    close = "" if where == "the parameters" else ", "
    doubled = (body[:at] + twice + close + body[at:]).encode()
    with pytest.raises(InvalidInput, match="twice in one object") as refused:
        request_from_json(doubled, None, "mha", "")
    assert quote(key) in str(refused.value)
    own_keys = {"the request": {"inputs", "parameters"}, "an input": set(tensor), "the parameters": set()}
    if key in own_keys[where]:
        return  # with the key once more, the object names it twice: refused above, rightly
    once = (body[:at] + json.dumps(key) + ": " + json.dumps(first) + close + body[at:]).encode()
    try:
        request_from_json(once, None, "mha", "")
    except InvalidInput as exc:
        assert "twice" not in str(exc)
