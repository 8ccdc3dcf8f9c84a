"""gRPC's ModelInfer messages <-> the protocol-neutral request and response (inference.py): what
only the protobuf form can get wrong (typed contents of another kind, raw_input_contents that do
not match the inputs) is checked here, in its words. Reading a request copies no tensor bytes.

The client side (encode_infer_request, decode_infer_response) is here too, and the hand-over
between workers (service/protocol/peers.py) sends a request as this module encodes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from export.layout import INPUT_NAME
from service.errors import InvalidInput
from service.proto import grpc_service_pb2 as pb
from service.protocol.inference import (
    DATATYPE,
    FLOAT32,
    SHM_OFFSET,
    SHM_REGION,
    SHM_SIZE,
    InferRequest,
    InferResponse,
    InputTensor,
    Parameters,
    RequestedOutput,
    Value,
    Words,
)
from service.protocol.shm import RegionSlice

REAL_KINDS = "biuf"  # bool, signed, unsigned, float: a float32 cast rounds them (a complex loses a part)

WORDS = Words(raw="raw_input_contents", values="contents.fp32_contents")
TYPED_FIELDS = ("bool", "int", "int64", "uint", "uint64", "fp32", "fp64", "bytes")
INT64_MAX = 2**63 - 1


def parameter_values(parameters: Any) -> Parameters:
    """InferParameters as plain values: each parameter's one set field (None when none is)."""
    if not parameters:
        return {}
    return {key: _value(p) for key, p in parameters.items()}


def _value(parameter: pb.InferParameter) -> Value:
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)  # type: ignore[no-any-return]


def request_from_proto(request: pb.ModelInferRequest) -> InferRequest:
    """The neutral request; raw_input_contents given to the inputs one by one, as bytes."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs) and len(request.inputs) == 1:
        raise InvalidInput(f"got {len(raw)} raw_input_contents entries for 1 input; expected exactly 1")
    paired = len(raw) == len(request.inputs)
    inputs = [_input(tensor, raw[i] if paired else None) for i, tensor in enumerate(request.inputs)]
    outputs = [RequestedOutput(out.name, parameter_values(out.parameters)) for out in request.outputs]
    return InferRequest(
        request.model_name,
        request.model_version,
        request.id,
        WORDS,
        inputs,
        outputs,
        parameter_values(request.parameters),
    )


def _input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> InputTensor:
    typed = _typed_fields(tensor)
    if typed and typed != ["fp32_contents"]:
        raise InvalidInput(f"input {tensor.name!r} is FP32 but carries contents.{', '.join(typed)}; send fp32_contents")
    values = np.asarray(tensor.contents.fp32_contents, dtype=FLOAT32) if typed else None
    if raw and values is not None:
        raise InvalidInput(
            f"input {tensor.name!r} has both raw_input_contents and contents.fp32_contents; send one of them"
        )
    return InputTensor(
        tensor.name, tensor.datatype, list(tensor.shape), parameter_values(tensor.parameters), raw or None, values
    )


def _typed_fields(tensor: pb.ModelInferRequest.InferInputTensor) -> list[str]:
    """The typed contents fields that hold values."""
    if not tensor.HasField("contents"):
        return []
    return [f"{kind}_contents" for kind in TYPED_FIELDS if len(getattr(tensor.contents, f"{kind}_contents"))]


def response_to_proto(response: InferResponse) -> pb.ModelInferResponse:
    """The reply: y in raw_output_contents, or, when it went to shared memory, the slice in
    the output's parameters and an empty contents entry (Triton's clients read one per output)."""
    reply = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version, id=response.id)
    out = reply.outputs.add(name=response.output_name, datatype=DATATYPE, shape=list(response.y.shape))
    _set_parameters(reply.parameters, response.parameters)
    target = response.slice
    if target is None:
        reply.raw_output_contents.append(response.y.tobytes())
        return reply
    placed: dict[str, int | str] = {SHM_REGION: target.region, SHM_SIZE: response.y.nbytes, SHM_OFFSET: target.offset}
    _set_parameters(out.parameters, placed)
    reply.raw_output_contents.append(b"")
    return reply


def _set_parameters(into: Any, values: dict[str, int | str] | Parameters) -> None:
    for key, value in values.items():
        parameter = into[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if value > INT64_MAX:
                parameter.uint64_param = value
            else:
                parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            parameter.Clear()  # set, with nothing in it: as the client sent it


def request_to_proto(request: InferRequest) -> pb.ModelInferRequest:
    """The request as a worker hands it to another (its data as raw bytes)."""
    message = pb.ModelInferRequest(model_name=request.model_name, model_version=request.model_version, id=request.id)
    _set_parameters(message.parameters, request.parameters)
    for tensor in request.inputs:
        entry = message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        _set_parameters(entry.parameters, tensor.parameters)
        if tensor.raw is not None:
            message.raw_input_contents.append(bytes(tensor.raw))
        elif tensor.values is not None and len(tensor.values):
            message.raw_input_contents.append(tensor.values.tobytes())  # float32 already: both decoders make it so
    for out in request.outputs:
        _set_parameters(message.outputs.add(name=out.name).parameters, out.parameters)
    return message


def response_from_proto(reply: pb.ModelInferResponse) -> InferResponse:
    """A worker's answer to a handed-over request; when the output went to shared memory, its
    slice (and, for y, a read-only stand-in of its shape that holds no memory)."""
    parameters = {k: v for k, v in parameter_values(reply.parameters).items() if isinstance(v, int | str)}
    out = reply.outputs[0]
    shape = list(out.shape)
    if not in_shared_memory(out):
        y = np.frombuffer(reply.raw_output_contents[0], dtype=FLOAT32).reshape(shape)  # (B, T, C)
        return InferResponse(reply.model_name, reply.model_version, reply.id, out.name, y, parameters)
    placed = parameter_values(out.parameters)
    target = RegionSlice(str(placed[SHM_REGION]), int(placed[SHM_SIZE] or 0), int(placed.get(SHM_OFFSET) or 0))
    y = np.broadcast_to(np.zeros((), FLOAT32), shape)  # (B, T, C), no bytes behind it
    return InferResponse(reply.model_name, reply.model_version, reply.id, out.name, y, parameters, target)


def in_shared_memory(output: pb.ModelInferResponse.InferOutputTensor) -> bool:
    """Whether a reply's output was written to a shared memory region instead of the reply."""
    return SHM_REGION in output.parameters


def encode_infer_request(
    x: np.ndarray, model_name: str = "mha", model_version: str = "", request_id: str = "", input_name: str = INPUT_NAME
) -> pb.ModelInferRequest:
    """The client side: a raw FP32 request of real numbers (a complex array would lose its
    imaginary parts to the cast, with no more than a warning)."""
    if (dtype := np.asarray(x).dtype).kind not in REAL_KINDS:
        raise TypeError(f"the input's dtype is {dtype}; expected real numbers, sent as float32")
    x = np.ascontiguousarray(x, dtype=FLOAT32)
    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version, id=request_id)
    request.inputs.add(name=input_name, datatype=DATATYPE, shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def decode_infer_response(response: pb.ModelInferResponse) -> np.ndarray:
    """The client side: the first output as a float32 array."""
    if not response.outputs or not response.raw_output_contents or not response.raw_output_contents[0]:
        raise ValueError("response carries no output (or it went to shared memory)")
    out = response.outputs[0]
    if out.datatype != DATATYPE:
        raise ValueError(f"output datatype {out.datatype!r}; expected {DATATYPE!r}")
    return np.frombuffer(response.raw_output_contents[0], dtype=FLOAT32).reshape(list(out.shape))
