"""Protobuf <-> numpy for ModelInfer, and the request checks of the protocol.

Pure functions: no I/O, no model, no gRPC context. Inputs are read without copies where the
wire allows (np.frombuffer on raw_input_contents); replies are always raw_output_contents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from export.layout import INPUT_NAME
from service.decode.control import SequenceControl
from service.errors import FeatureOff, InvalidInput, quote
from service.proto import grpc_service_pb2 as pb
from service.protocol.shm import OFF_MESSAGE, Placement, SystemRegions

if TYPE_CHECKING:
    from service.engine.served import ServedModel

DATATYPE = "FP32"
FLOAT32 = np.dtype("<f4")


def decode_infer_request(
    request: pb.ModelInferRequest, model: ServedModel, regions: SystemRegions | None = None
) -> np.ndarray:
    """The request's (B, T, C) float32 input, checked against the served model's tensors (its
    name and version are checked once, by answer_infer); read from a shared memory region when
    the input names one."""
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
    where = placement(tensor.parameters, f"input {tensor.name!r}", regions)
    if where is None:
        x = _read_contents(request, tensor, shape)
    else:
        x = _read_region(request, tensor, shape, where, regions)
    return x  # its values are the core's to check: a NaN or inf shows in the output (see core)


def _check_shape(shape: list[int], model: ServedModel) -> tuple[int, int, int]:
    d_model, max_seq_len = model.config.d_model, model.config.max_seq_len
    if len(shape) != 3:
        raise InvalidInput(f"input shape {shape} has rank {len(shape)}; expected rank 3: {_expected_shape(model)}")
    B, T, C = shape
    if C != d_model:
        raise InvalidInput(f"input shape {shape}: C = {C}; expected C = {d_model}: {_expected_shape(model)}")
    if B < 1:
        raise InvalidInput(f"input shape {shape}: B = {B}; expected B >= 1")
    if T < 1:
        raise InvalidInput(f"input shape {shape}: T = {T}; expected T >= 1: {_expected_shape(model)}")
    if T > max_seq_len:
        raise InvalidInput(f"input shape {shape}: T = {T} exceeds max_seq_len {max_seq_len}: {_expected_shape(model)}")
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


def _expected_shape(model: ServedModel) -> str:
    return f"[B, T, {model.config.d_model}] with 1 <= T <= {model.config.max_seq_len}"


# Protocol features this server does not implement: refused, never silently ignored.
UNSUPPORTED_OUTPUT_PARAMETERS = ("classification",)
SEQUENCE_ID_LIMIT = 128  # characters of a string sequence_id
SEQUENCE_HEADER = "mha-sequence-id"  # gRPC metadata and HTTP header: what L7 balancers hash on
SEQUENCE_OFFSET = "sequence_offset"  # tokens the client believes the server holds before a step
TIMEOUT, PRIORITY = "timeout", "priority"  # Triton's request parameters: honoured, and refused but for 0
SEQUENCE_LENGTH = "sequence_length"  # tokens the server holds after a step, in its response
SHM_REGION, SHM_SIZE, SHM_OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
TYPED_FIELDS = ("bool", "int", "int64", "uint", "uint64", "fp32", "fp64", "bytes")


def _refuse_unsupported(request: pb.ModelInferRequest) -> None:
    for out in request.outputs:
        for key in UNSUPPORTED_OUTPUT_PARAMETERS:
            if key in out.parameters:
                raise InvalidInput(
                    f"output {out.name!r} parameter {key!r} is not supported by this server; "
                    "send the request without it"
                )


def sequence_control(request: pb.ModelInferRequest) -> SequenceControl | None:
    """Triton's sequence parameters and our `sequence_offset`, checked: None for a stateless
    request (no sequence_id)."""
    parameters = request.parameters
    if not parameters:  # most requests: nothing to read
        return None
    flags = {key: _flag(parameters, key) for key in ("sequence_start", "sequence_end")}
    if "sequence_id" not in parameters:
        if any(flags.values()) or SEQUENCE_OFFSET in parameters:
            raise InvalidInput(
                f"sequence_start, sequence_end and {SEQUENCE_OFFSET} need a sequence_id (int64 > 0 or a string)"
            )
        return None
    offset = (
        _count_parameter(parameters, SEQUENCE_OFFSET, "the request", "token count")
        if SEQUENCE_OFFSET in parameters
        else None
    )
    if flags["sequence_start"] and offset not in (None, 0):
        raise InvalidInput(f"{SEQUENCE_OFFSET} {offset} with sequence_start: a sequence starts at offset 0")
    return SequenceControl(
        _sequence_id(parameters["sequence_id"]), flags["sequence_start"], flags["sequence_end"], offset
    )


def parameter_values(parameters: Any) -> dict[str, bool | int | float | str]:
    """InferParameters as plain values: each parameter's one set field."""
    return {key: getattr(p, str(p.WhichOneof("parameter_choice"))) for key, p in parameters.items()}


def check_sequence_header(control: SequenceControl | None, header: str | None) -> None:
    """Balancers route on the `mha-sequence-id` header and the server computes on the
    `sequence_id` parameter: a request whose two disagree could reach a replica that does not
    hold its sequence, so it is refused."""
    if header is None:
        return
    in_parameters = None if control is None else str(control.id)
    if header != in_parameters:
        raise InvalidInput(
            f"the {SEQUENCE_HEADER} header {quote(header)} disagrees with the request's sequence_id "
            f"{quote(in_parameters) if in_parameters is not None else '(none)'}: send the same id in both, or neither"
        )


def _sequence_id(param: Any) -> int | str:
    kind = param.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        number = int(getattr(param, kind))
        if number <= 0:
            raise InvalidInput(f"sequence_id {number}: expected an integer >= 1 (0 means no sequence) or a string")
        return number
    if kind != "string_param":
        raise InvalidInput(f"sequence_id must be an int64_param or a string_param, got {kind or 'nothing'}")
    text = str(param.string_param)
    if not 1 <= len(text) <= SEQUENCE_ID_LIMIT:
        raise InvalidInput(f"sequence_id {quote(text)}: expected 1 to {SEQUENCE_ID_LIMIT} characters")
    return text


def _flag(parameters: Any, key: str) -> bool:
    if key not in parameters:
        return False
    if parameters[key].WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInput(f"{key} must be a bool_param")
    return bool(parameters[key].bool_param)


def request_timeout_s(request: pb.ModelInferRequest) -> float | None:
    """Triton's `timeout` (microseconds the request may take; 0 or absent: no limit of its own),
    as seconds; and its `priority`, refused unless it is the one level this server has."""
    parameters = request.parameters
    if not parameters:
        return None
    level = _count_parameter(parameters, PRIORITY, "the request", "priority level") if PRIORITY in parameters else 0
    if level != 0:
        raise InvalidInput(f"{PRIORITY} {level}: this server has one priority level; send 0 or leave it out")
    if TIMEOUT not in parameters:
        return None
    microseconds = _count_parameter(parameters, TIMEOUT, "the request", "microsecond count")
    return microseconds / 1e6 if microseconds else None


def names_shared_memory(request: pb.ModelInferRequest) -> bool:
    """Does an input or a requested output name a shared memory placement?"""
    tensors = [*request.inputs, *request.outputs]
    return any(key in t.parameters for t in tensors for key in (SHM_REGION, SHM_SIZE, SHM_OFFSET))


def placement(parameters: Any, where: str, regions: SystemRegions | None) -> Placement | None:
    """The shared memory placement that a tensor's parameters name, or None when they name none."""
    if not parameters:  # most tensors carry none
        return None
    if not any(key in parameters for key in (SHM_REGION, SHM_SIZE, SHM_OFFSET)):
        return None
    if regions is None or not regions.enabled:
        raise FeatureOff(OFF_MESSAGE)
    if SHM_REGION not in parameters or SHM_SIZE not in parameters:
        raise InvalidInput(f"{where}: shared memory needs both {SHM_REGION!r} and {SHM_SIZE!r}")
    region = parameters[SHM_REGION]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput(f"{where}: {SHM_REGION!r} must be a string_param naming a registered region")
    size = _count_parameter(parameters, SHM_SIZE, where)
    offset = _count_parameter(parameters, SHM_OFFSET, where) if SHM_OFFSET in parameters else 0
    return Placement(region.string_param, size, offset)


def _count_parameter(parameters: Any, key: str, where: str, unit: str = "byte count") -> int:
    """A byte count, offset or token count: an int64_param or uint64_param, not negative."""
    kind = parameters[key].WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidInput(f"{where}: {key!r} must be an int64_param {unit}, got {kind or 'nothing'}")
    value = int(getattr(parameters[key], kind))
    if value < 0:
        raise InvalidInput(f"{where}: {key!r} is {value}; expected a {unit} >= 0")
    return value


def output_placement(
    request: pb.ModelInferRequest, shape: tuple[int, ...], regions: SystemRegions | None
) -> Placement | None:
    """Where the output goes when the request asks for it in shared memory: checked before the
    compute, so that a bad placement costs nothing."""
    for out in request.outputs:
        where = placement(out.parameters, f"output {out.name!r}", regions)
        if where is not None and regions is not None:
            need = int(np.prod(shape)) * FLOAT32.itemsize
            if where.byte_size < need:
                raise InvalidInput(
                    f"output {out.name!r}: {SHM_SIZE} {where.byte_size} is too small; shape {list(shape)} of FP32 "
                    f"needs {need} bytes"
                )
            regions.check(where, need)
            return where
    return None


def _read_region(
    request: pb.ModelInferRequest,
    tensor: pb.ModelInferRequest.InferInputTensor,
    shape: tuple[int, int, int],
    where: Placement,
    regions: SystemRegions | None,
) -> np.ndarray:
    if request.raw_input_contents or _typed_fields(tensor):
        raise InvalidInput(f"input {tensor.name!r} names a shared memory region and also carries data; send one")
    x = np.empty(shape, dtype=FLOAT32)  # (B, T, C)
    if where.byte_size != x.nbytes:
        raise InvalidInput(
            f"input {tensor.name!r}: {SHM_SIZE} {where.byte_size}; shape {list(shape)} of FP32 needs exactly "
            f"{x.nbytes} bytes"
        )
    assert regions is not None  # placement() refused the request otherwise
    regions.read(where, x)
    return x


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


def encode_infer_response(
    y: np.ndarray,
    model: ServedModel,
    request_id: str,
    backend: str,
    target: Placement | None = None,
    regions: SystemRegions | None = None,
    extra: dict[str, int | str] | None = None,
) -> pb.ModelInferResponse:
    """The reply: y in raw_output_contents, or written to `target` in shared memory (then the
    output carries the placement's parameters, and its contents entry is empty: Triton's clients
    read one entry per output); `extra` response parameters
    (a step's sequence_length and where the sequence lives)."""
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    out = response.outputs.add(name=model.output_name, datatype=DATATYPE, shape=list(y.shape))
    response.parameters["backend"].string_param = backend
    for key, value in (extra or {}).items():
        if isinstance(value, int):
            response.parameters[key].int64_param = value
        else:
            response.parameters[key].string_param = value
    y = np.ascontiguousarray(y, dtype=FLOAT32)
    if target is None or regions is None:
        response.raw_output_contents.append(y.tobytes())
        return response
    regions.write(target, y)
    out.parameters[SHM_REGION].string_param = target.region
    out.parameters[SHM_SIZE].int64_param = y.nbytes
    out.parameters[SHM_OFFSET].int64_param = target.offset
    response.raw_output_contents.append(b"")  # as Triton does: a contents entry for every output, here empty
    return response


def in_shared_memory(output: pb.ModelInferResponse.InferOutputTensor) -> bool:
    """Whether a reply's output was written to a shared memory region instead of the reply."""
    return SHM_REGION in output.parameters


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
    if not response.outputs or not response.raw_output_contents or not response.raw_output_contents[0]:
        raise ValueError("response carries no output (or it went to shared memory)")
    out = response.outputs[0]
    if out.datatype != DATATYPE:
        raise ValueError(f"output datatype {out.datatype!r}; expected {DATATYPE!r}")
    return np.frombuffer(response.raw_output_contents[0], dtype=FLOAT32).reshape(list(out.shape))
