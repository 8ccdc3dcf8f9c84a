"""Protobuf <-> numpy for ModelInfer, and the request checks of the protocol.

Pure functions: no I/O, no model, no gRPC context. Inputs are read without copies where the
wire allows (np.frombuffer on raw_input_contents); replies are always raw_output_contents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from export.layout import INPUT_NAME
from service.errors import InvalidInput, quote
from service.proto import grpc_service_pb2 as pb

if TYPE_CHECKING:
    from service.served import ServedModel

DATATYPE = "FP32"
FLOAT32 = np.dtype("<f4")


def decode_infer_request(request: pb.ModelInferRequest, model: ServedModel) -> np.ndarray:
    """The request's (B, T, C) float32 input, checked against the served model."""
    model.identity.check(request.model_name, request.model_version)
    if len(request.inputs) != 1:
        names = ", ".join(quote(i.name, 32) for i in request.inputs[:3]) + (", ..." if len(request.inputs) > 3 else "")
        raise InvalidInput(
            f"expected exactly 1 input tensor {model.input_name!r}, got {len(request.inputs)}: [{names}]"
        )
    tensor = request.inputs[0]
    if tensor.name != model.input_name:
        raise InvalidInput(f"unknown input {quote(tensor.name)}; the model's input is {model.input_name!r}")
    if tensor.datatype != DATATYPE:
        raise InvalidInput(f"input {tensor.name!r} has datatype {quote(tensor.datatype)}; expected {DATATYPE!r}")
    shape = _check_shape(list(tensor.shape), model)
    for out in request.outputs:
        if out.name != model.output_name:
            raise InvalidInput(
                f"unknown requested output {quote(out.name)}; the model's output is {model.output_name!r}"
            )
    _refuse_unsupported(request)
    x = _read_contents(request, tensor, shape)
    if not np.isfinite(x).all():
        raise InvalidInput(
            f"input {tensor.name!r} holds {int((~np.isfinite(x)).sum())} NaN or inf values; expected finite floats"
        )
    return x


def _check_shape(shape: list[int], model: ServedModel) -> tuple[int, int, int]:
    d_model, max_seq_len = model.config.d_model, model.config.max_seq_len
    expected = f"[B, T, {d_model}] with 1 <= T <= {max_seq_len}"
    if len(shape) != 3:
        raise InvalidInput(f"input shape {shape} has rank {len(shape)}; expected rank 3: {expected}")
    B, T, C = shape
    if C != d_model:
        raise InvalidInput(f"input shape {shape}: C = {C}; expected C = {d_model}: {expected}")
    if B < 1:
        raise InvalidInput(f"input shape {shape}: B = {B}; expected B >= 1")
    if T < 1:
        raise InvalidInput(f"input shape {shape}: T = {T}; expected T >= 1: {expected}")
    if T > max_seq_len:
        raise InvalidInput(f"input shape {shape}: T = {T} exceeds max_seq_len {max_seq_len}: {expected}")
    if B > model.max_request_rows:
        raise InvalidInput(
            f"input shape {shape}: B = {B} exceeds this server's limit of {model.max_request_rows} rows per request; "
            "split the batch"
        )
    need = model.attention_mb(B, T)
    if need > model.max_attention_mb:
        raise InvalidInput(
            f"input shape {shape}: attention needs {need:.0f} MiB (B x {model.config.n_head} heads x T x T x 4 bytes); "
            f"this server's limit is {model.max_attention_mb:g} MiB per request: split the batch or shorten T"
        )
    return B, T, C


# Protocol features this server does not implement: refused, never silently ignored.
UNSUPPORTED_REQUEST_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")
UNSUPPORTED_TENSOR_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
UNSUPPORTED_OUTPUT_PARAMETERS = ("classification", *UNSUPPORTED_TENSOR_PARAMETERS)
TYPED_FIELDS = ("bool", "int", "int64", "uint", "uint64", "fp32", "fp64", "bytes")


def _refuse_unsupported(request: pb.ModelInferRequest) -> None:
    places: list[tuple[str, Any, tuple[str, ...]]] = [("request", request.parameters, UNSUPPORTED_REQUEST_PARAMETERS)]
    places += [(f"input {t.name!r}", t.parameters, UNSUPPORTED_TENSOR_PARAMETERS) for t in request.inputs]
    places += [(f"output {o.name!r}", o.parameters, UNSUPPORTED_OUTPUT_PARAMETERS) for o in request.outputs]
    for where, parameters, unsupported in places:
        for key in unsupported:
            if key in parameters:
                raise InvalidInput(
                    f"{where} parameter {key!r} is not supported by this server; send the request without it"
                )


def _typed_fields(tensor: pb.ModelInferRequest.InferInputTensor) -> list[str]:
    """The typed contents fields that hold values."""
    if not tensor.HasField("contents"):
        return []
    return [f"{kind}_contents" for kind in TYPED_FIELDS if len(getattr(tensor.contents, f"{kind}_contents"))]


def _read_contents(
    request: pb.ModelInferRequest, tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, int, int]
) -> np.ndarray:
    count = shape[0] * shape[1] * shape[2]
    typed = _typed_fields(tensor)
    has_typed = typed == ["fp32_contents"]
    if typed and not has_typed:
        raise InvalidInput(f"input {tensor.name!r} is FP32 but carries contents.{', '.join(typed)}; send fp32_contents")
    if request.raw_input_contents:
        if has_typed:
            raise InvalidInput(
                f"input {tensor.name!r} has both raw_input_contents and contents.fp32_contents; send one of them"
            )
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
    raise InvalidInput(f"input {tensor.name!r} carries no data; expected raw_input_contents or contents.fp32_contents")


def encode_infer_response(y: np.ndarray, model: ServedModel, request_id: str, backend: str) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    response.outputs.add(name=model.output_name, datatype=DATATYPE, shape=list(y.shape))
    response.parameters["backend"].string_param = backend
    response.raw_output_contents.append(np.ascontiguousarray(y, dtype=FLOAT32).tobytes())
    return response


def encode_infer_request(
    x: np.ndarray, model_name: str = "mha", model_version: str = "", request_id: str = "", input_name: str = INPUT_NAME
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
