"""Protobuf <-> numpy for ModelInfer, and the request checks of the protocol.

Pure functions: no I/O, no model, no gRPC context. Inputs are read without copies where the
wire allows (np.frombuffer on raw_input_contents); replies are always raw_output_contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.errors import InvalidInput, ModelNotFound
from service.proto import grpc_service_pb2 as pb

DATATYPE = "FP32"
FLOAT32 = np.dtype("<f4")


@dataclass(frozen=True)
class ModelSpec:
    """What a request must match."""

    name: str
    version: str
    input_name: str
    output_name: str
    d_model: int
    max_seq_len: int
    max_request_rows: int  # largest B accepted in one request


@dataclass(frozen=True)
class DecodedRequest:
    x: np.ndarray  # (B, T, C) float32, read-only view of the request bytes where possible
    request_id: str  # the client's `id`, echoed back


def check_model(served: tuple[str, str], name: str, version: str) -> None:
    """`served` is the (name, version) this server holds; an empty version means the latest."""
    served_name, served_version = served
    if name != served_name:
        raise ModelNotFound(f"unknown model {name!r}; this server serves {served_name!r}")
    if version not in ("", served_version):
        raise ModelNotFound(
            f"unknown version {version!r} of model {served_name!r}; "
            f"available: [{served_version!r}] (or empty for latest)"
        )


def decode_infer_request(request: pb.ModelInferRequest, spec: ModelSpec) -> DecodedRequest:
    check_model((spec.name, spec.version), request.model_name, request.model_version)
    if len(request.inputs) != 1:
        raise InvalidInput(
            f"expected exactly 1 input tensor {spec.input_name!r}, got {len(request.inputs)}: "
            f"{[i.name for i in request.inputs]}"
        )
    tensor = request.inputs[0]
    if tensor.name != spec.input_name:
        raise InvalidInput(f"unknown input {tensor.name!r}; the model's input is {spec.input_name!r}")
    if tensor.datatype != DATATYPE:
        raise InvalidInput(f"input {tensor.name!r} has datatype {tensor.datatype!r}; expected {DATATYPE!r}")
    shape = _check_shape(list(tensor.shape), spec)
    for out in request.outputs:
        if out.name != spec.output_name:
            raise InvalidInput(f"unknown requested output {out.name!r}; the model's output is {spec.output_name!r}")
    x = _read_contents(request, tensor, shape)
    if not np.isfinite(x).all():
        raise InvalidInput(
            f"input {tensor.name!r} holds {int((~np.isfinite(x)).sum())} NaN or inf values; expected finite floats"
        )
    return DecodedRequest(x=x, request_id=request.id)


def _check_shape(shape: list[int], spec: ModelSpec) -> tuple[int, int, int]:
    expected = f"[B, T, {spec.d_model}] with 1 <= T <= {spec.max_seq_len}"
    if len(shape) != 3:
        raise InvalidInput(f"input shape {shape} has rank {len(shape)}; expected rank 3: {expected}")
    B, T, C = shape
    if C != spec.d_model:
        raise InvalidInput(f"input shape {shape}: C = {C}; expected C = {spec.d_model}: {expected}")
    if B < 1:
        raise InvalidInput(f"input shape {shape}: B = {B}; expected B >= 1")
    if T < 1:
        raise InvalidInput(f"input shape {shape}: T = {T}; expected T >= 1: {expected}")
    if T > spec.max_seq_len:
        raise InvalidInput(f"input shape {shape}: T = {T} exceeds max_seq_len {spec.max_seq_len}: {expected}")
    if B > spec.max_request_rows:
        raise InvalidInput(
            f"input shape {shape}: B = {B} exceeds this server's limit of {spec.max_request_rows} rows per request; "
            "split the batch"
        )
    return B, T, C


def _read_contents(
    request: pb.ModelInferRequest, tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, int, int]
) -> np.ndarray:
    count = shape[0] * shape[1] * shape[2]
    has_typed = tensor.HasField("contents") and len(tensor.contents.fp32_contents) > 0
    if request.raw_input_contents:
        if has_typed:
            raise InvalidInput("input 'x' has both raw_input_contents and contents.fp32_contents; send one of them")
        if len(request.raw_input_contents) != 1:
            raise InvalidInput(
                f"got {len(request.raw_input_contents)} raw_input_contents entries for 1 input; expected exactly 1"
            )
        raw = request.raw_input_contents[0]
        if len(raw) != count * FLOAT32.itemsize:
            raise InvalidInput(
                f"raw_input_contents holds {len(raw)} bytes; shape {list(shape)} of FP32 needs "
                f"{count * FLOAT32.itemsize} bytes ({count} x 4)"
            )
        return np.frombuffer(raw, dtype=FLOAT32).reshape(shape)  # (B, T, C), no copy
    if has_typed:
        values = tensor.contents.fp32_contents
        if len(values) != count:
            raise InvalidInput(f"contents.fp32_contents holds {len(values)} values; shape {list(shape)} needs {count}")
        return np.asarray(values, dtype=FLOAT32).reshape(shape)  # (B, T, C)
    raise InvalidInput("input 'x' carries no data; expected raw_input_contents or contents.fp32_contents")


def encode_infer_response(y: np.ndarray, spec: ModelSpec, request_id: str, backend: str) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request_id)
    response.outputs.add(name=spec.output_name, datatype=DATATYPE, shape=list(y.shape))
    response.parameters["backend"].string_param = backend
    response.raw_output_contents.append(np.ascontiguousarray(y, dtype=FLOAT32).tobytes())
    return response


def encode_infer_request(
    x: np.ndarray, model_name: str = "mha", model_version: str = "", request_id: str = "", input_name: str = "x"
) -> pb.ModelInferRequest:
    """The client side: a raw FP32 request."""
    x = np.ascontiguousarray(x, dtype=FLOAT32)
    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version, id=request_id)
    request.inputs.add(name=input_name, datatype=DATATYPE, shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def decode_infer_response(response: pb.ModelInferResponse) -> np.ndarray:
    """The client side: the first output as a float32 array."""
    if not response.outputs or not response.raw_output_contents:
        raise ValueError("response carries no output")
    out = response.outputs[0]
    if out.datatype != DATATYPE:
        raise ValueError(f"output datatype {out.datatype!r}; expected {DATATYPE!r}")
    return np.frombuffer(response.raw_output_contents[0], dtype=FLOAT32).reshape(list(out.shape))
