"""What both protocols ask beyond reading, answered by this worker through the door: an inference
(decode the input from the request or from shared memory, compute it stateless or as a decode
step, answer in the reply or into shared memory), the repository's load and unload calls, log
and trace settings, and the shared memory regions. gRPC and HTTP decode into the neutral
InferRequest first, so every check applies to both.

`Answering` is what the wire's handlers call; with `--workers N` the app hands them
`WorkerAnswers` (workers.py), which wraps these answers and hands to another worker what only it
can answer.
"""

from __future__ import annotations

from typing import Protocol

from service.engine.door import Door, SequenceControl
from service.errors import InvalidInput
from service.logs import LogSetting
from service.proto import grpc_service_pb2 as pb
from service.protocol import log_calls, model_calls
from service.protocol.calls import Call
from service.protocol.cuda_shm import CudaRegion
from service.protocol.inference import (
    SEQUENCE_LENGTH,
    InferRequest,
    InferResponse,
    answered,
    check_sequence_header,
    decode_input,
    output_slice,
    queue_request,
    sequence_control,
)
from service.protocol.shm import Region, Regions
from service.tracing import TraceValues

Changes = dict[str, list[str] | None]  # trace settings to change; None: back to the value at start


class Answering(Protocol):
    async def infer(
        self, request: InferRequest, deadline: float | None, header: str | None = None, call: Call | None = None
    ) -> InferResponse: ...
    async def load(self, name: str) -> None: ...
    async def unload(self, name: str) -> None: ...
    async def log_settings(self, changes: dict[str, LogSetting]) -> dict[str, LogSetting]: ...
    async def trace_settings(self, changes: Changes) -> TraceValues: ...
    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None: ...
    async def unregister(self, name: str) -> None: ...
    async def status(self, name: str) -> list[Region]: ...
    async def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None: ...
    async def unregister_cuda(self, name: str) -> None: ...
    async def cuda_status(self, name: str) -> list[CudaRegion]: ...
    async def statistics(self, name: str, version: str) -> list[pb.ModelStatistics]: ...


class Answers:
    def __init__(self, door: Door, regions: Regions) -> None:
        self.door, self.regions = door, regions

    async def infer(
        self, request: InferRequest, deadline: float | None, header: str | None = None, call: Call | None = None
    ) -> InferResponse:
        """`deadline` is on the door's clock (None: none); `header` the request's mha-sequence-id
        header, if it carries one; `call` its call scope (None: a benchmark of this layer alone)."""
        entry = self.door.entry(request.model_name)  # the model named, checked first
        control = sequence_control(request)
        if call is not None:
            call.step = control is not None  # counted in the sequence model's statistics
        check_sequence_header(control, header)
        queue = queue_request(request)  # the stateless model's priority and queue timeout
        if control is not None:
            deadline = self._step_deadline(queue, deadline)
        version = self.door.route(entry, request.model_version, control)  # ready; which version
        if call is not None:
            call.version = version.version  # counted in its statistics
        model = version.model
        x = decode_input(request, model, self.regions)
        target = output_slice(request, x.shape, self.regions)
        self.hold(call, x.nbytes)
        if control is None:
            y, backend = await self.door.infer(version, x, deadline, queue, request.id)
            return answered(request, model, y, backend, target, self.regions)
        y, backend, extra = await self.door.step(version, control, x, deadline, request.id)
        response = answered(request, model, y, backend, target, self.regions, extra)
        response.model_name = entry  # the entry the step was sent to: mha or mha_sequence
        return response

    def _step_deadline(self, queue: tuple[int, float | None], deadline: float | None) -> float | None:
        """A step's deadline: the sooner of the call's and the request's `timeout`. The sequence
        model has one priority level."""
        priority, own_timeout = queue
        if priority != 0:
            raise InvalidInput(
                f"priority {priority}: the steps of sequences have one priority level; send 0 or leave it out"
            )
        if own_timeout is None:
            return deadline
        own = self.door.now() + own_timeout
        return own if deadline is None else min(deadline, own)

    def hold(self, call: Call | None, input_bytes: int) -> None:
        """The request's input and its answer, in the in-flight budget until its call closes (a
        stream's request: once its answer is written); refused at once when the budget is full."""
        lease = self.door.hold(2 * input_bytes)
        if call is None:  # nobody closes it (a benchmark of this layer alone): nothing to hold
            lease.release()
        else:
            call.leases.append(lease)

    async def load(self, name: str) -> None:
        await self.door.load(name)

    async def unload(self, name: str) -> None:
        await self.door.unload(name)

    async def log_settings(self, changes: dict[str, LogSetting]) -> dict[str, LogSetting]:
        return log_calls.apply(changes)

    async def trace_settings(self, changes: Changes) -> TraceValues:
        return self.door.trace_settings(changes)

    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.regions.register(name, key, offset, byte_size)

    async def unregister(self, name: str) -> None:
        self.regions.unregister(name)

    async def status(self, name: str) -> list[Region]:
        return self.regions.status(name)

    async def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.regions.register_cuda(name, raw_handle, device_id, byte_size)

    async def unregister_cuda(self, name: str) -> None:
        self.regions.cuda.unregister(name)

    async def cuda_status(self, name: str) -> list[CudaRegion]:
        return self.regions.cuda.status(name)

    async def statistics(self, name: str, version: str) -> list[pb.ModelStatistics]:
        """Triton's statistics of one entry (`name`) or every entry, in one version or every one."""
        return model_calls.statistics(self.door, name, version)


__all__ = ["SEQUENCE_LENGTH", "Answering", "Answers", "Changes", "SequenceControl"]
