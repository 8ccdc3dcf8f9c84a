"""One inference request and its answer, whatever protocol carried them: gRPC (grpc_codec.py)
and HTTP (http_codec.py) decode into `InferRequest` and encode from `InferResponse`, and every
check that does not depend on the protocol is here, once, in words that fit both.

Parameters are plain values (bool, int, float, str; None for a gRPC parameter with nothing set).
A tensor's data is raw little-endian bytes or float32 values, as the client sent it, with the
name the client's protocol gives it (`Words`), so that a message names what the client wrote.
Pure functions: no I/O but the shared memory regions a request names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from service.decode.control import SequenceControl
from service.errors import FeatureOff, InvalidInput, described, quote
from service.protocol.shm import OFF_MESSAGE, Regions, RegionSlice

if TYPE_CHECKING:
    from service.engine.door import ServedModel

Value = bool | int | float | str | None
Parameters = dict[str, Value]

DATATYPE = "FP32"
FLOAT32 = np.dtype("<f4")
UNSUPPORTED_OUTPUT_PARAMETERS = ("classification",)  # refused, never silently ignored
SEQUENCE_ID_LIMIT = 128  # characters of a string sequence_id
SEQUENCE_HEADER = "mha-sequence-id"  # gRPC metadata and HTTP header: what L7 balancers hash on
SEQUENCE_OFFSET = "sequence_offset"  # tokens the client believes the server holds before a step
TIMEOUT, PRIORITY = "timeout", "priority"  # Triton's request parameters, under the schedule policy
SEQUENCE_LENGTH = "sequence_length"  # tokens the server holds after a step, in its response
SHM_REGION, SHM_SIZE, SHM_OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
SHM_KEYS = (SHM_REGION, SHM_SIZE, SHM_OFFSET)


@dataclass(frozen=True, slots=True)
class Words:
    """What a protocol calls a tensor's data: raw bytes, and a list of values."""

    raw: str
    values: str


@dataclass(slots=True)
class InputTensor:
    name: str
    datatype: str
    shape: list[int]
    parameters: Parameters = field(default_factory=dict)
    raw: bytes | memoryview | None = None  # little-endian bytes, as sent
    values: np.ndarray | None = None  # float32 values, flat, as sent


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: Parameters = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    model_name: str
    model_version: str
    id: str
    words: Words
    inputs: list[InputTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: Parameters = field(default_factory=dict)


@dataclass(slots=True)
class InferResponse:
    """`y` (B, T, C), in the answer or, when `slice` is set, already written there."""

    model_name: str
    model_version: str
    id: str
    output_name: str
    y: np.ndarray
    parameters: dict[str, int | str] = field(default_factory=dict)
    slice: RegionSlice | None = None


def decode_input(request: InferRequest, model: ServedModel, regions: Regions | None = None) -> np.ndarray:
    """The request's (B, T, C) float32 input, checked against the served model's tensors (its
    name and version are checked once, by Answers.infer); read from a shared memory region when
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
    shape = _check_shape(tensor.shape, model)
    for out in request.outputs:
        if out.name != model.output_name:
            raise InvalidInput(
                f"unknown requested output {quote(out.name)}; the model's output is {model.output_name!r}"
            )
        for key in UNSUPPORTED_OUTPUT_PARAMETERS:
            if key in out.parameters:
                raise InvalidInput(
                    f"output {out.name!r} parameter {key!r} is not supported by this server; "
                    "send the request without it"
                )
    if len(request.outputs) > 1:  # one answer for two asks would leave a client's second one unanswered
        raise InvalidInput(f"output {model.output_name!r} is requested {len(request.outputs)} times; request it once")
    where = region_slice(tensor.parameters, f"input {tensor.name!r}", regions)
    if where is None:
        return _read_data(tensor, shape, request.words)
    return _read_region(tensor, shape, where, regions)  # its values are the core's to check (see core)


def _check_shape(shape: list[int], model: ServedModel) -> tuple[int, int, int]:
    d_model, max_seq_len = model.config.d_model, model.config.max_seq_len
    if len(shape) != 3:
        shown = f"{shape[:6]}..." if len(shape) > 6 else f"{shape}"
        raise InvalidInput(f"input shape {shown} has rank {len(shape)}; expected rank 3: {_expected_shape(model)}")
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


def _read_data(tensor: InputTensor, shape: tuple[int, int, int], words: Words) -> np.ndarray:
    count = shape[0] * shape[1] * shape[2]
    if tensor.raw is not None:
        if len(tensor.raw) != count * FLOAT32.itemsize:
            raise InvalidInput(
                f"{words.raw} holds {len(tensor.raw)} bytes; shape {list(shape)} of FP32 needs "
                f"{count * FLOAT32.itemsize} bytes ({count} x 4)"
            )
        return np.frombuffer(tensor.raw, dtype=FLOAT32).reshape(shape)  # (B, T, C), no copy
    if tensor.values is not None and len(tensor.values):
        if len(tensor.values) != count:
            raise InvalidInput(f"{words.values} holds {len(tensor.values)} values; shape {list(shape)} needs {count}")
        return tensor.values.reshape(shape)  # (B, T, C)
    raise InvalidInput(f"input {tensor.name!r} carries no data; expected {words.raw} or {words.values}")


def _read_region(
    tensor: InputTensor, shape: tuple[int, int, int], where: RegionSlice, regions: Regions | None
) -> np.ndarray:
    if tensor.raw is not None or (tensor.values is not None and len(tensor.values)):
        raise InvalidInput(f"input {tensor.name!r} names a shared memory region and also carries data; send one")
    x = np.empty(shape, dtype=FLOAT32)  # (B, T, C)
    if where.byte_size != x.nbytes:
        raise InvalidInput(
            f"input {tensor.name!r}: {SHM_SIZE} {where.byte_size}; shape {list(shape)} of FP32 needs exactly "
            f"{x.nbytes} bytes"
        )
    assert regions is not None  # region_slice() refused the request otherwise
    regions.read(where, x)
    return x


def sequence_control(request: InferRequest) -> SequenceControl | None:
    """Triton's sequence parameters and our `sequence_offset`, checked: None for a stateless
    request (no sequence_id)."""
    parameters = request.parameters
    if not parameters:  # most requests: nothing to read
        return None
    flags = {key: flag(parameters, key) for key in ("sequence_start", "sequence_end")}
    if "sequence_id" not in parameters:
        if any(flags.values()) or SEQUENCE_OFFSET in parameters:
            raise InvalidInput(
                f"sequence_start, sequence_end and {SEQUENCE_OFFSET} need a sequence_id (an integer > 0 or a string)"
            )
        return None
    offset = (
        count_parameter(parameters, SEQUENCE_OFFSET, "the request", "token count")
        if SEQUENCE_OFFSET in parameters
        else None
    )
    if flags["sequence_start"] and offset not in (None, 0):
        raise InvalidInput(f"{SEQUENCE_OFFSET} {offset} with sequence_start: a sequence starts at offset 0")
    return SequenceControl(
        _sequence_id(parameters["sequence_id"]), flags["sequence_start"], flags["sequence_end"], offset
    )


def one_header(name: str, values: list[str]) -> str | None:
    """A header's value (None: absent). Sent more than once, it is refused unless every copy says
    the same: a balancer may read the last copy, or all of them joined, where this server would
    read the first, and the two would act on different values."""
    if len(values) > 1 and len(set(values)) > 1:
        shown = ", ".join(quote(value, 32) for value in values[:3]) + (", ..." if len(values) > 3 else "")
        raise InvalidInput(
            f"the {name} header is sent {len(values)} times with different values ({shown}); send it once"
        )
    return values[0] if values else None


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


def _sequence_id(value: Value) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidInput(f"sequence_id {value}: expected an integer >= 1 (0 means no sequence) or a string")
        return value
    if not isinstance(value, str):
        raise InvalidInput(f"sequence_id must be an integer or a string, got {described(value)}")
    if not 1 <= len(value) <= SEQUENCE_ID_LIMIT:
        raise InvalidInput(f"sequence_id {quote(value)}: expected 1 to {SEQUENCE_ID_LIMIT} characters")
    return value


def flag(parameters: Parameters, key: str, default: bool = False) -> bool:
    """A boolean parameter: true or false, nothing that reads as one; `default` when absent."""
    if key not in parameters:
        return default
    value = parameters[key]
    if not isinstance(value, bool):
        raise InvalidInput(f"{key} must be a boolean (true or false), got {described(value)}")
    return value


def queue_request(request: InferRequest) -> tuple[int, float | None]:
    """Triton's `priority` (0 or absent: the model's default level; the engine checks the levels)
    and `timeout` (microseconds the request may wait in the queue; 0 or absent: none of its own,
    as seconds) of a request."""
    parameters = request.parameters
    if not parameters:
        return 0, None
    level = count_parameter(parameters, PRIORITY, "the request", "priority level") if PRIORITY in parameters else 0
    if TIMEOUT not in parameters:
        return level, None
    microseconds = count_parameter(parameters, TIMEOUT, "the request", "microsecond count")
    return level, microseconds / 1e6 if microseconds else None


def names_shared_memory(request: InferRequest) -> bool:
    """Does an input or a requested output name a shared memory slice?"""
    tensors: list[InputTensor | RequestedOutput] = [*request.inputs, *request.outputs]
    return any(key in t.parameters for t in tensors for key in SHM_KEYS)


def region_slice(parameters: Parameters, where: str, regions: Regions | None) -> RegionSlice | None:
    """The shared memory slice that a tensor's parameters name, or None when they name none."""
    if not parameters or not any(key in parameters for key in SHM_KEYS):  # most tensors carry none
        return None
    if regions is None or not regions.enabled:
        raise FeatureOff(OFF_MESSAGE)
    if SHM_REGION not in parameters or SHM_SIZE not in parameters:
        raise InvalidInput(f"{where}: shared memory needs both {SHM_REGION!r} and {SHM_SIZE!r}")
    region = parameters[SHM_REGION]
    if not isinstance(region, str):
        raise InvalidInput(f"{where}: {SHM_REGION!r} must be a string naming a registered region")
    size = count_parameter(parameters, SHM_SIZE, where)
    offset = count_parameter(parameters, SHM_OFFSET, where) if SHM_OFFSET in parameters else 0
    return RegionSlice(region, size, offset)


def count_parameter(parameters: Parameters, key: str, where: str, unit: str = "byte count") -> int:
    """A byte count, offset or token count: an integer, not negative."""
    value = parameters[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"{where}: {key!r} must be an integer {unit}, got {described(value)}")
    if value < 0:
        raise InvalidInput(f"{where}: {key!r} is {value}; expected a {unit} >= 0")
    return value


def output_slice(request: InferRequest, shape: tuple[int, ...], regions: Regions | None) -> RegionSlice | None:
    """Where the output goes when the request asks for it in shared memory: checked before the
    compute, so that a bad slice costs nothing."""
    for out in request.outputs:
        where = region_slice(out.parameters, f"output {out.name!r}", regions)
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


def answered(
    request: InferRequest,
    model: ServedModel,
    y: np.ndarray,
    backend: str,
    target: RegionSlice | None = None,
    regions: Regions | None = None,
    extra: dict[str, int | str] | None = None,
) -> InferResponse:
    """The answer to `request`: y in it, or written to `target` in shared memory; the backend
    that computed it and `extra` response parameters (a step's sequence_length and where the
    sequence lives)."""
    y = np.ascontiguousarray(y, dtype=FLOAT32)
    if target is not None and regions is not None:
        regions.write(target, y)
    parameters: dict[str, int | str] = {"backend": backend, **(extra or {})}
    return InferResponse(model.name, model.version, request.id, model.output_name, y, parameters, target)
