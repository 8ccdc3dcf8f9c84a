"""The other workers of one server (`--workers N`): each sequence has one owner worker, and a
step that reaches another worker is handed to its owner over a Unix-domain socket.

SO_REUSEPORT spreads connections, not sequences, over the workers: a client that reconnects
between steps (curl, most HTTP clients, a channel that reconnects) lands on any of them. A
sequence's state lives in one process only, its owner's, chosen from the sequence id alone
(crc32, the same in every process and every restart), so every connection reaches it. The
owner answers the handed-over request as it would its own (service/protocol/handover.py); its
status and message come back as they are. System shared memory regions are kept by one worker
(REGION_KEEPER) for all of them: registrations, status and requests that name a region are
handed to it (service/protocol/regions.py), so every connection sees one set of regions.

The hand-over is one frame each way on a pooled stream connection, not a gRPC call: the request
as gRPC's message, its mha-sequence-id header and its remaining time; the answer's
status code and the serialized response (or the error message): cheaper than a gRPC call over
the same socket (docs/benchmarks.md, bench/scaleout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import Message

from service.errors import DeadlineExceeded, NotReady, Relayed
from service.proto import grpc_service_pb2 as pb
from service.protocol.calls import HANDED_OVER
from service.protocol.grpc_codec import request_to_proto, response_from_proto
from service.protocol.inference import InferRequest, InferResponse

if TYPE_CHECKING:
    from service.engine.door import SequenceId

log = logging.getLogger(__name__)

FORWARDED_METHOD = HANDED_OVER  # the metric label, on the receiving worker, of calls handed over by another
REQUEST_HEAD = struct.Struct("!BIHd")  # kind, request bytes, header bytes, seconds left (< 0: no deadline)
INFER, REGISTER, UNREGISTER, STATUS, LOAD, UNLOAD, LOG, TRACE, STATS = range(9)  # ..., statistics
REQUESTS: dict[int, type[Message]] = {
    INFER: pb.ModelInferRequest,
    REGISTER: pb.SystemSharedMemoryRegisterRequest,
    UNREGISTER: pb.SystemSharedMemoryUnregisterRequest,
    STATUS: pb.SystemSharedMemoryStatusRequest,
    LOAD: pb.RepositoryModelLoadRequest,
    UNLOAD: pb.RepositoryModelUnloadRequest,
    LOG: pb.LogSettingsRequest,
    TRACE: pb.TraceSettingRequest,
    STATS: pb.ModelStatisticsRequest,
}
REGION_KEEPER = 0  # the worker that keeps the shared memory regions of all workers
ANSWER_HEAD = struct.Struct("!BI")  # status code (0: OK), then the response's bytes or the error message
CODES = {code.value[0]: code for code in grpc.StatusCode}

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def socket_path(directory: Path, index: int) -> Path:
    """Where worker `index` listens for steps handed over by the others."""
    return directory / f"worker-{index}.sock"


def owner_of(sequence_id: SequenceId, workers: int) -> int:
    """The worker that holds `sequence_id`'s state: the same answer in every process."""
    return zlib.crc32(str(sequence_id).encode()) % workers


async def read_request(reader: asyncio.StreamReader) -> tuple[int, bytes, str | None, float | None]:
    """One handed-over request: (its kind, its bytes, its mha-sequence-id header, seconds left)."""
    kind, size, header_size, seconds = REQUEST_HEAD.unpack(await reader.readexactly(REQUEST_HEAD.size))
    rest = await reader.readexactly(header_size + size)  # the header, then the request
    header = rest[:header_size].decode() if header_size else None
    return kind, rest[header_size:], header, seconds if seconds >= 0 else None


def answer_frame(code: grpc.StatusCode, body: bytes) -> bytes:
    return ANSWER_HEAD.pack(code.value[0], len(body)) + body


class WorkerPeers:
    """This worker's view of the others: who owns a sequence, and connections to each owner."""

    def __init__(self, index: int, workers: int, directory: Path) -> None:
        self.index, self.workers, self.directory = index, workers, directory
        self._idle: dict[int, list[Connection]] = {}
        self._all_listening = False

    def owner(self, sequence_id: SequenceId) -> int | None:
        """The owner of `sequence_id` when it is another worker; None when it is this one."""
        owner = owner_of(sequence_id, self.workers)
        return None if owner == self.index else owner

    @property
    def others(self) -> list[int]:
        return [worker for worker in range(self.workers) if worker != self.index]

    def all_listening(self) -> bool:
        """Does every other worker listen for handed-over steps (each does once it has loaded)?
        Once they all have, the answer stays yes: a worker that restarts later is waited for by
        the calls handed to it, not by the replica's readiness."""
        if not self._all_listening:
            self._all_listening = all(socket_path(self.directory, worker).exists() for worker in self.others)
        return self._all_listening

    @property
    def region_keeper(self) -> int | None:
        """The worker that keeps the shared memory regions when it is another; None when it is this one."""
        return None if self.index == REGION_KEEPER else REGION_KEEPER

    async def forward(
        self, worker: int, request: InferRequest, header: str | None, timeout: float | None
    ) -> InferResponse:
        """`worker`'s answer to `request` (handed over as gRPC's message)."""
        answer = await self.call(worker, INFER, request_to_proto(request), header, timeout)
        return response_from_proto(pb.ModelInferResponse.FromString(answer))

    async def call(
        self, worker: int, kind: int, request: Message, header: str | None = None, timeout: float | None = 30.0
    ) -> bytes:
        """`worker`'s serialized answer to `request` (of `kind`); its error status raised as
        Relayed, and a worker that cannot be reached (restarting, draining) as NotReady: the
        client retries."""
        body, head = request.SerializeToString(), (header or "").encode()
        seconds = -1.0 if timeout is None else timeout
        frame = REQUEST_HEAD.pack(kind, len(body), len(head), seconds) + head + body
        try:
            connection = await self._connection(worker)
        except OSError as exc:
            raise NotReady(_unreachable(worker, exc)) from exc
        try:
            async with asyncio.timeout(timeout):  # no task of its own, unlike wait_for: a hand-over is short
                code, answer = await self._exchange(connection, frame)
        except (OSError, asyncio.IncompleteReadError) as exc:  # TimeoutError is an OSError: first
            connection[1].close()
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(f"deadline passed while worker {worker} computed the handed-over call") from exc
            raise NotReady(_unreachable(worker, exc)) from exc
        except BaseException:  # a cancellation: the frame's answer may still come, on a connection nobody reads
            connection[1].close()
            raise
        self._idle.setdefault(worker, []).append(connection)
        if code is not grpc.StatusCode.OK:
            raise Relayed(code.name, answer.decode(errors="replace"))
        return answer

    async def _connection(self, worker: int) -> Connection:
        idle = self._idle.get(worker)
        if idle:
            return idle.pop()
        return await asyncio.open_unix_connection(socket_path(self.directory, worker))

    @staticmethod
    async def _exchange(connection: Connection, frame: bytes) -> tuple[grpc.StatusCode, bytes]:
        reader, writer = connection
        writer.write(frame)
        await writer.drain()
        code, size = ANSWER_HEAD.unpack(await reader.readexactly(ANSWER_HEAD.size))
        return CODES.get(code, grpc.StatusCode.UNKNOWN), await reader.readexactly(size)

    async def close(self) -> None:
        for connections in self._idle.values():
            for _, writer in connections:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        self._idle.clear()


def _unreachable(worker: int, exc: BaseException) -> str:
    return (
        f"worker {worker} of this replica, which holds this sequence or the shared memory regions, is not "
        f"reachable ({type(exc).__name__}); retry shortly"
    )
