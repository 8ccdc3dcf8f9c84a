"""The receiving side of a hand-over (`--workers N`): the steps of this worker's sequences that
reached another worker, (on the region keeper) the shared memory calls and the requests that name
a region, and another worker's load, unload and settings calls, answered here as if they had
arrived here; and another worker's audit verdicts, taken as this worker's own (peers.py has the
sending side and the frame format, workers.py the wrapper that decides what goes where)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.struct_pb2 import Struct

from service.proto import grpc_service_pb2 as pb
from service.protocol import log_calls, render, trace_calls
from service.protocol.answer import Answering, Answers
from service.protocol.calls import Call, Calls
from service.protocol.grpc_codec import request_from_proto, response_to_proto
from service.protocol.peers import (
    CUDA_REGISTER,
    CUDA_STATUS,
    CUDA_UNREGISTER,
    DISTRUST,
    FORWARDED_METHOD,
    INFER,
    LOAD,
    LOG,
    REGISTER,
    REQUESTS,
    STATS,
    TRACE,
    UNLOAD,
    UNREGISTER,
    Handed,
    answer_frame,
    read_request,
    verdict_of,
)

log = logging.getLogger(__name__)


class Handover:
    def __init__(self, local: Answers, answers: Answering, calls: Calls) -> None:
        """`local`: this worker's answers; `answers`: the same behind the workers' wrapper, for
        inference requests (a region keeper's hand-over of a step goes on to its owner)."""
        self.local, self.answers, self.calls = local, answers, calls
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()  # open peer connections, closed at stop

    async def start(self, path: Path) -> None:
        """Listen on `path` (a socket left there by this worker's previous life is replaced)."""
        path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One peer connection: frames answered one after another until the peer closes it, or
        until this worker stops. asyncio runs this as a task of its own and reports how that
        task ended: a cancellation (this worker stopping) ends the connection here, as a normal
        end, so that a clean stop logs no error for each open connection."""
        self._connections.add(writer)
        try:
            while True:
                writer.write(await self._answer(await read_request(reader)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer closed the connection (or gave up on a step): nothing to answer
        except asyncio.CancelledError:
            log.debug("a hand-over connection ended: this worker is stopping")
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _answer(self, handed: Handed) -> bytes:
        """The answer frame to `handed`, answered in a call of the id, and in the trace, of the call
        that handed it over."""
        kind = handed.kind
        async with self.calls.in_band(
            FORWARDED_METHOD, None, handed.request_id, kind == INFER, carrier=handed.metadata, traced=handed.traced
        ) as call:
            if kind not in REQUESTS:
                raise RuntimeError(f"a peer sent a frame of unknown kind {kind}")
            try:
                request = REQUESTS[kind].FromString(handed.body)
            except DecodeError as exc:
                raise RuntimeError(f"a peer sent a frame that is not a {REQUESTS[kind].__name__}") from exc
            response = await self._respond(kind, request, handed.header, handed.seconds, call)
            return answer_frame(grpc.StatusCode.OK, response.SerializeToString())
        return answer_frame(call.code, call.message.encode())

    async def _respond(self, kind: int, request: Any, header: str | None, seconds: float | None, call: Call) -> Message:
        """What this worker answers, as if the call had reached it: requests naming a sequence
        this worker does not own go on to their owner (the region keeper's hand-overs do)."""
        local = self.local
        if kind == INFER:
            deadline = None if seconds is None else local.door.now() + seconds
            answer = await self.answers.infer(request_from_proto(request), deadline, header, call)
            return response_to_proto(answer)
        if kind == REGISTER:
            await local.register(request.name, request.key, request.offset, request.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()
        if kind == UNREGISTER:
            await local.unregister(request.name)
            return pb.SystemSharedMemoryUnregisterResponse()
        if kind == CUDA_REGISTER:
            await local.register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
            return pb.CudaSharedMemoryRegisterResponse()
        if kind == CUDA_UNREGISTER:
            await local.unregister_cuda(request.name)
            return pb.CudaSharedMemoryUnregisterResponse()
        if kind == CUDA_STATUS:
            return render.cuda_shm_status(await local.cuda_status(request.name))
        if kind == LOAD:  # another worker's load call: this worker's part of it
            await local.load(request.model_name)
            return pb.RepositoryModelLoadResponse()
        if kind == UNLOAD:
            await local.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()
        if kind == LOG:  # another worker's log settings call: this worker's part of it
            return log_calls.to_proto(await local.log_settings(log_calls.from_proto(request.settings)))
        if kind == TRACE:  # another worker's trace settings call
            return trace_calls.to_proto(await local.trace_settings(trace_calls.from_proto(request.settings)))
        if kind == STATS:  # another worker's statistics call: this worker's part of the sums
            return pb.ModelStatisticsResponse(model_stats=await local.statistics(request.name, request.version))
        if kind == DISTRUST:  # another worker's audit found a backend computing wrongly
            local.door.distrust(verdict_of(request))
            return Struct()
        return render.system_shm_status(await local.status(request.name))

    async def stop(self) -> None:
        """No new connections; the open ones closed, so that their readers end as the peer's close."""
        for writer in list(self._connections):
            writer.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
