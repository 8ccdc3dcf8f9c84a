"""KServe v2 REST bodies (JSON, or JSON + binary data: Triton's binary tensor extension) <-> the
protocol-neutral request and response (inference.py), with every refusal in the words of the
JSON the client wrote; and protobuf messages as Triton's HTTP endpoint writes them."""

from __future__ import annotations

import json
from typing import Any, TypeGuard

import numpy as np
import orjson
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from service.errors import InvalidInput, quote
from service.protocol.http_json import parse_json
from service.protocol.inference import (
    DATATYPE,
    SHM_OFFSET,
    SHM_REGION,
    SHM_SIZE,
    InferRequest,
    InferResponse,
    InputTensor,
    Parameters,
    RequestedOutput,
    Words,
    flag,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
WORDS = Words(raw="binary data (binary_data_size)", values="data")
INT64_RANGE = (-(2**63), 2**63 - 1)
INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def proto_json(message: Message) -> dict[str, Any]:
    """A message as Triton's HTTP endpoint writes it: proto field names, zeros included, and
    64-bit integers as JSON numbers (protobuf's JSON mapping would write them as strings)."""
    doc = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message.DESCRIPTOR, doc)


def _numbers(descriptor: Descriptor, doc: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        value = doc.get(field.name)
        if value is None:
            continue
        if field.type in INT64:
            doc[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            inner = field.message_type.fields_by_name["value"].message_type
            for item in value.values() if inner is not None else ():
                _numbers(inner, item)
        elif field.message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _numbers(field.message_type, item)
    return doc


def json_object(value: object, what: str) -> dict[str, Any]:
    """A JSON object where the protocol wants one (absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def is_int64(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and INT64_RANGE[0] <= value <= INT64_RANGE[1]


def _parameters(value: object, what: str) -> Parameters:
    """A JSON object of parameters: each value a string, a number or a boolean."""
    parameters: Parameters = {}
    for key, item in json_object(value, what).items():
        if isinstance(item, int) and not isinstance(item, bool) and not is_int64(item):
            raise InvalidInput(f"parameter {quote(str(key))}: {quote(str(item))} does not fit 64 bits")
        if not isinstance(item, bool | int | float | str):
            kind = "null" if item is None else type(item).__name__.replace("dict", "object").replace("list", "array")
            expected = "expected a string, a number or a boolean"
            raise InvalidInput(f"parameter {quote(str(key))} is a JSON {kind}; {expected}")
        parameters[str(key)] = item
    return parameters


def request_from_json(body: bytes, header_length: int | None, name: str, version: str) -> tuple[InferRequest, bool]:
    """(the neutral request, whether the client asked for binary outputs)."""
    split = len(body) if header_length is None else header_length
    if not 0 <= split <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} {header_length} is outside the body's {len(body)} bytes")
    doc = parse_json(body[:split], "the request")
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs", []), list):
        raise InvalidInput("the request must be a JSON object with an 'inputs' list")
    parameters = _parameters(doc.get("parameters"), "the request's parameters")
    binary_out = flag(parameters, "binary_data_output")
    parameters.pop("binary_data_output", None)  # the codec's own, not the request's
    binary, offset, inputs = memoryview(body)[split:], 0, []
    for tensor in doc.get("inputs", []):
        if not isinstance(tensor, dict):
            raise InvalidInput("each input must be a JSON object with name, shape, datatype and data")
        entry, offset = _input(tensor, binary, offset)
        inputs.append(entry)
    outputs_doc = doc.get("outputs") or []
    if not isinstance(outputs_doc, list):
        raise InvalidInput("the request's outputs must be a JSON list")
    outputs = []
    for output in outputs_doc:
        output = json_object(output, "each requested output")
        out_parameters = _parameters(output.get("parameters"), "an output's parameters")
        binary_out = flag(out_parameters, "binary_data", binary_out)
        out_parameters.pop("binary_data", None)
        outputs.append(RequestedOutput(str(output.get("name", "")), out_parameters))
    if offset != len(binary):  # bytes no input claims: the client's sizes and its data disagree
        raise InvalidInput(
            f"{len(binary) - offset} bytes of binary data follow the inputs' binary_data_size ({offset} bytes "
            f"in all); expected the body to end there"
        )
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):  # echoed in the answer: a client's number or object would come back changed
        raise InvalidInput(f"the request's id must be a JSON string, got {type(request_id).__name__}")
    request = InferRequest(name, version, request_id[:256], WORDS, inputs, outputs, parameters)
    return request, binary_out


def _input(tensor: dict[str, Any], binary: memoryview, offset: int) -> tuple[InputTensor, int]:
    """One JSON input tensor, and the offset of the next one's binary data."""
    name = str(tensor.get("name", ""))
    shape = tensor.get("shape", [])
    if not isinstance(shape, list) or not all(is_int64(d) for d in shape):
        raise InvalidInput(f"input {quote(name)}: shape must be a list of 64-bit integers, got {quote(str(shape))}")
    parameters = _parameters(tensor.get("parameters"), "an input's parameters")
    entry = InputTensor(name, str(tensor.get("datatype", "")), shape, parameters)
    size = parameters.pop("binary_data_size", None)
    if size is not None:
        if not is_int64(size) or size < 0 or offset + size > len(binary):
            left = len(binary) - offset
            raise InvalidInput(f"binary_data_size {quote(str(size))} does not fit the {left} bytes sent")
        if "data" in tensor:
            raise InvalidInput(f"input {quote(name)} has both binary_data_size and data; send one of them")
        entry.raw = binary[offset : offset + size]
        return entry, offset + size
    if "data" in tensor:
        entry.values = _float32_data(name, tensor["data"])
    return entry, offset


JSON_KINDS = {bool: "booleans", str: "strings", type(None): "nulls", dict: "objects"}


def _float32_data(name: str, data: object) -> np.ndarray:
    """JSON data, nested or flat, as row-major float32: numbers only. A boolean or a numeric
    string is refused, as gRPC's typed contents refuse bool_contents for FP32, never read as one."""
    kinds = _leaf_types(data if isinstance(data, list) else [data]) - {int, float}
    if kinds:
        got = ", ".join(sorted(JSON_KINDS.get(kind, kind.__name__) for kind in kinds))
        raise InvalidInput(f"input {quote(name)}: data must be JSON numbers, got {got}")
    try:
        with np.errstate(over="ignore"):  # beyond FP32's range: inf, which the finiteness check refuses
            return np.asarray(data, dtype=np.float32).ravel()
    except OverflowError as exc:  # an integer literal beyond float's range
        raise InvalidInput(f"input {quote(name)}: data holds an integer too large for FP32") from exc
    except ValueError as exc:  # nested lists of unequal lengths
        raise InvalidInput(f"input {quote(name)}: data must be numbers in equal-length lists ({exc})") from exc


def _leaf_types(values: list[Any]) -> set[type]:
    """The types of the values in nested lists, lists aside (a C-speed pass per list)."""
    kinds = set(map(type, values))
    if list in kinds:
        kinds.discard(list)
        for inner in values:
            if type(inner) is list:
                kinds |= _leaf_types(inner)
    return kinds


def response_to_http(response: InferResponse, binary: bool) -> web.Response:
    tensor: dict[str, Any] = {"name": response.output_name, "datatype": DATATYPE, "shape": list(response.y.shape)}
    doc = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "parameters": response.parameters,
        "outputs": [tensor],
    }
    if (target := response.slice) is not None:  # the slice, and no data: binary_data_size 0,
        placed = {SHM_REGION: target.region, SHM_SIZE: response.y.nbytes, SHM_OFFSET: target.offset}
        tensor["parameters"] = {**placed, "binary_data_size": 0}  # which Triton's C++ client reads
        return web.json_response(doc)
    if not binary:  # each float32 widened, as json.dumps writes it (and Triton), in a tenth of the time
        tensor["data"] = response.y.ravel().astype(np.float64)
        body = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
        return web.Response(body=body, content_type="application/json", charset="utf-8")
    raw = response.y.tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(doc).encode()
    return web.Response(
        body=head + raw, content_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))}
    )
