"""Workers at the edge (`--workers N`): one wrapper in front of this worker's answers that hands
to another worker what only it can answer, and tells every worker what changes them all.

- A step of a sequence another worker owns goes to its owner (the worker its first step reached,
  named where every worker reads it: peers.py). Its tensor is checked here first, so that a
  refusal is worded for the client's protocol; when it lives in regions this worker keeps, the
  owner gets the tensor itself, and its output is written here.
- System shared memory regions are kept by one worker (REGION_KEEPER) for all of them: the
  registrations, the status requests and every inference request that names a region are handed
  to it, so that a region registered through any connection is usable through every connection,
  and Status and Unregister see one set.
- Load and unload calls, and log and trace settings, act in every worker at once; the first
  refusal is the answer.

The wire's handlers call `WorkerAnswers` exactly as they call `Answers` (the `Answering`
interface): they do not know workers exist. peers.py is the sending side and the frame format;
handover.py the receiving side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from google.protobuf.message import Message

from service.engine.door import SequenceControl, ServedModel
from service.logs import LogSetting
from service.proto import grpc_service_pb2 as pb
from service.protocol import log_calls, trace_calls
from service.protocol.answer import Answers, Changes
from service.protocol.calls import Call
from service.protocol.cuda_shm import CudaRegion
from service.protocol.inference import (
    DATATYPE,
    SHM_KEYS,
    InferRequest,
    InferResponse,
    InputTensor,
    answered,
    check_sequence_header,
    decode_input,
    names_shared_memory,
    output_slice,
    sequence_control,
)
from service.protocol.peers import (
    CUDA_REGISTER,
    CUDA_STATUS,
    CUDA_UNREGISTER,
    LOAD,
    LOG,
    REGISTER,
    STATS,
    STATUS,
    TRACE,
    UNLOAD,
    UNREGISTER,
    WorkerPeers,
)
from service.protocol.shm import Region
from service.tracing import TraceValues


class WorkerAnswers:
    def __init__(self, local: Answers, peers: WorkerPeers) -> None:
        self.local, self.peers = local, peers
        self.regions = KeptRegions(local, peers)

    async def infer(
        self, request: InferRequest, deadline: float | None, header: str | None = None, call: Call | None = None
    ) -> InferResponse:
        """This worker's answer, or the one of the worker that holds the request's sequence or regions."""
        control = sequence_control(request) if "sequence_id" in request.parameters else None  # else: checked there
        keeper = self.peers.region_keeper
        shared = keeper is not None and names_shared_memory(request)
        owner = None if control is None or shared else self.peers.owner(control.id, control.start)
        if owner is None and not shared:  # answered here
            if control is not None and control.start:
                return await self._started_here(request, deadline, header, call, control)
            return await self.local.infer(request, deadline, header, call)
        check_sequence_header(control, header)
        if call is not None:
            call.step = control is not None  # counted in the sequence model's statistics
        timeout = None if deadline is None else max(0.0, deadline - self.local.door.now())
        if shared and keeper is not None:
            self._check_carried_tensor(request)
            return await self.peers.forward(keeper, request, header, timeout)
        assert owner is not None
        return await self._handed_over(request, owner, header, timeout, call)

    async def _started_here(
        self,
        request: InferRequest,
        deadline: float | None,
        header: str | None,
        call: Call | None,
        control: SequenceControl,
    ) -> InferResponse:
        """A first step answered by this worker; refused, it leaves no owner (a sequence it
        restarted keeps its state, and its steps still reach it through this worker)."""
        try:
            return await self.local.infer(request, deadline, header, call)
        except BaseException:
            self.peers.release(control.id)
            raise

    def _model(self, request: InferRequest) -> ServedModel:
        """The served model the request's version names (the latest when it names none)."""
        door = self.local.door
        return door.route(door.entry(request.model_name), request.model_version, sequence_control(request)).model

    def _check_carried_tensor(self, request: InferRequest) -> None:
        """A tensor carried in the request (not in a region) is checked before the request is
        handed over, so that a refusal is worded for the client's protocol (the worker it goes to
        reads it as gRPC)."""
        if not any(key in tensor.parameters for tensor in request.inputs for key in SHM_KEYS):
            decode_input(request, self._model(request))

    async def _handed_over(
        self, request: InferRequest, owner: int, header: str | None, timeout: float | None, call: Call | None
    ) -> InferResponse:
        """A step of a sequence `owner` holds, its tensor read here (from the request or from this
        worker's regions), its output written here where a region of this worker's takes it."""
        local = self.local
        model = self._model(request)
        x = decode_input(request, model, local.regions)
        target = output_slice(request, x.shape, local.regions)
        local.hold(call, x.nbytes)
        if names_shared_memory(request):
            request.inputs[0] = InputTensor(model.input_name, DATATYPE, list(x.shape), raw=x.tobytes())  # (B, T, C)
            request.outputs = []
        response = await self.peers.forward(owner, request, header, timeout)
        if target is None:
            return response
        parameters = response.parameters
        backend = str(parameters.pop("backend", ""))
        placed = answered(request, model, response.y, backend, target, local.regions, parameters)
        placed.model_name = response.model_name
        return placed

    async def load(self, name: str) -> None:
        await self._everywhere(self.local.load(name), LOAD, pb.RepositoryModelLoadRequest(model_name=name))

    async def unload(self, name: str) -> None:
        await self._everywhere(self.local.unload(name), UNLOAD, pb.RepositoryModelUnloadRequest(model_name=name))

    async def log_settings(self, changes: dict[str, LogSetting]) -> dict[str, LogSetting]:
        settings = await self.local.log_settings(changes)
        if changes:
            await self._others(LOG, log_calls.request(changes))
        return settings

    async def trace_settings(self, changes: Changes) -> TraceValues:
        settings = await self.local.trace_settings(changes)
        if changes:
            await self._others(TRACE, trace_calls.request(changes))
        return settings

    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self.regions.register(name, key, offset, byte_size)

    async def unregister(self, name: str) -> None:
        await self.regions.unregister(name)

    async def status(self, name: str) -> list[Region]:
        return await self.regions.status(name)

    async def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        await self.regions.register_cuda(name, raw_handle, device_id, byte_size)

    async def unregister_cuda(self, name: str) -> None:
        await self.regions.unregister_cuda(name)

    async def cuda_status(self, name: str) -> list[CudaRegion]:
        return await self.regions.cuda_status(name)

    async def statistics(self, name: str, version: str) -> list[pb.ModelStatistics]:
        """The replica's statistics: every worker's, summed, whichever worker is asked (a client
        reading them twice on two connections sees counts that only grow, as perf_analyzer needs)."""
        here = await self.local.statistics(name, version)  # an unknown model or version: refused here
        request = pb.ModelStatisticsRequest(name=name, version=version)
        answers = await asyncio.gather(*(self.peers.call(w, STATS, request) for w in self.peers.others))
        for answer in answers:
            _add_statistics(here, pb.ModelStatisticsResponse.FromString(answer).model_stats)
        return here

    async def _everywhere(self, here: Awaitable[None], kind: int, request: Message) -> None:
        """A repository call here and, at the same time, in every other worker (each reads the
        same repository): every worker acts, and the first refusal is the answer."""
        others = [self.peers.call(w, kind, request, timeout=None) for w in self.peers.others]
        for result in await asyncio.gather(here, *others, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    async def _others(self, kind: int, request: Message) -> None:
        await asyncio.gather(*(self.peers.call(worker, kind, request) for worker in self.peers.others))


def _add_statistics(into: list[pb.ModelStatistics], other: Iterable[pb.ModelStatistics]) -> None:
    """Another worker's statistics added into `into`, entry by entry ((name, version))."""
    mine = {(s.name, s.version): s for s in into}
    for stats in other:
        if (kept := mine.get((stats.name, stats.version))) is None:
            into.append(stats)
        else:
            _add(kept, stats)


PHASES = ("compute_input", "compute_infer", "compute_output")


def _add(into: pb.ModelStatistics, other: pb.ModelStatistics) -> None:
    """Counts and nanoseconds summed; the last inference the latest of the two; batch statistics
    summed batch size by batch size."""
    into.last_inference = max(into.last_inference, other.last_inference)
    into.inference_count += other.inference_count
    into.execution_count += other.execution_count
    for name in ("success", "fail", "queue", *PHASES):
        _add_duration(getattr(into.inference_stats, name), getattr(other.inference_stats, name))
    sizes = {b.batch_size: b for b in into.batch_stats}
    for batch in other.batch_stats:
        if (kept := sizes.get(batch.batch_size)) is None:
            into.batch_stats.add().CopyFrom(batch)
        else:
            for name in PHASES:
                _add_duration(getattr(kept, name), getattr(batch, name))
    ordered = [pb.InferBatchStatistics() for _ in into.batch_stats]  # copies, smallest batch first, as rendered
    for copy, batch in zip(ordered, sorted(into.batch_stats, key=lambda b: b.batch_size), strict=True):
        copy.CopyFrom(batch)
    del into.batch_stats[:]
    into.batch_stats.extend(ordered)


def _add_duration(into: pb.StatisticDuration, other: pb.StatisticDuration) -> None:
    into.count += other.count
    into.ns += other.ns


class KeptRegions:
    """The shared memory region calls of every worker, made by the one that keeps the regions
    (REGION_KEEPER): here when this worker is it, else handed to it."""

    def __init__(self, local: Answers, peers: WorkerPeers) -> None:
        self.local, self.peers = local, peers

    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=byte_size)
        await self._kept(lambda: self.local.register(name, key, offset, byte_size), REGISTER, request)

    async def unregister(self, name: str) -> None:
        request = pb.SystemSharedMemoryUnregisterRequest(name=name)
        await self._kept(lambda: self.local.unregister(name), UNREGISTER, request)

    async def status(self, name: str) -> list[Region]:
        """The regions named `name`, or all of them for an empty name (fd -1: kept by another worker)."""
        if (keeper := self.peers.region_keeper) is None:
            return await self.local.status(name)
        answer = await self.peers.call(keeper, STATUS, pb.SystemSharedMemoryStatusRequest(name=name))
        regions = pb.SystemSharedMemoryStatusResponse.FromString(answer).regions.values()
        return [Region(r.name, r.key, int(r.offset), int(r.byte_size), -1) for r in regions]

    async def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        request = pb.CudaSharedMemoryRegisterRequest(
            name=name, raw_handle=raw_handle, device_id=device_id, byte_size=byte_size
        )
        here = lambda: self.local.register_cuda(name, raw_handle, device_id, byte_size)  # noqa: E731
        await self._kept(here, CUDA_REGISTER, request)

    async def unregister_cuda(self, name: str) -> None:
        request = pb.CudaSharedMemoryUnregisterRequest(name=name)
        await self._kept(lambda: self.local.unregister_cuda(name), CUDA_UNREGISTER, request)

    async def cuda_status(self, name: str) -> list[CudaRegion]:
        """The CUDA regions named `name`, or all of them (pointer 0: kept by another worker)."""
        if (keeper := self.peers.region_keeper) is None:
            return await self.local.cuda_status(name)
        answer = await self.peers.call(keeper, CUDA_STATUS, pb.CudaSharedMemoryStatusRequest(name=name))
        regions = pb.CudaSharedMemoryStatusResponse.FromString(answer).regions.values()
        return [CudaRegion(r.name, int(r.device_id), int(r.byte_size), 0) for r in regions]

    async def _kept(self, here: Callable[[], Awaitable[None]], kind: int, request: Message) -> None:
        """A change of the regions: made here when this worker keeps them, else by their keeper."""
        if (keeper := self.peers.region_keeper) is None:
            return await here()
        await self.peers.call(keeper, kind, request)
