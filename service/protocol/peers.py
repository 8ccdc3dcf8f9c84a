"""The other workers of one server (`--workers N`): each sequence has one owner worker, and a
step that reaches another worker is handed to its owner over a Unix-domain socket.

SO_REUSEPORT spreads connections, not sequences, over the workers: a client that reconnects
between steps (curl, most HTTP clients, a channel that reconnects) lands on any of them. A
sequence's state lives in one process only, its owner's: the worker its first step reached, so
that a client on one channel never pays a hand-over. Each live sequence names its owner in a
folder the workers share (a symbolic link, made atomically, named by a digest of the id), so
every connection reaches it; the owner removes the name when the sequence ends or is evicted, and
names itself instead in a second folder as the worker that held it last: a step that arrives after
is handed to that worker, which says what became of the sequence (ended, evicted and why, dropped),
not merely that this worker does not know it.
The owner answers the handed-over request as it would its own (service/protocol/handover.py);
its status and message come back as they are. System shared memory regions are kept by one
worker (REGION_KEEPER) for all of them: registrations, status and requests that name a region
are handed to it (service/protocol/workers.py), so every connection sees one set of regions.
An audit that finds a backend computing wrongly on a device the workers share (the CPU; the GPUs,
unless each has its own) tells the others (`Broadcast`), and each distrusts its backend of that
name as its own audit would; it also names the verdict in a third folder, so that a worker
restarted later does too.

The hand-over is one frame each way on a pooled stream connection, not a gRPC call: the request
as gRPC's message, its remaining time, and as metadata its mha-sequence-id header and the id and
trace context of the call handing it over (its lines on both workers share the id, its spans the
trace); the answer's status code and the serialized response (or the error message): cheaper
than a gRPC call over the same socket (docs/benchmarks.md, bench/scaleout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
from google.protobuf.message import Message
from google.protobuf.struct_pb2 import Struct

from service.engine.door import Verdict
from service.errors import DeadlineExceeded, NotReady, Relayed
from service.logs import request_id_var
from service.proto import grpc_service_pb2 as pb
from service.protocol.calls import HANDED_OVER
from service.protocol.grpc_codec import request_to_proto, response_from_proto
from service.protocol.inference import SEQUENCE_HEADER, InferRequest, InferResponse
from service.tracing import pass_trace_on

if TYPE_CHECKING:
    from service.engine.door import SequenceId

log = logging.getLogger(__name__)

FORWARDED_METHOD = HANDED_OVER  # the metric label, on the receiving worker, of calls handed over by another
REQUEST_HEAD = struct.Struct("!BIHd")  # kind, request bytes, metadata bytes, seconds left (< 0: no deadline)
REQUEST_ID = "request-id"  # metadata: the id of the call that hands a request over
UNTRACED = "untraced"  # metadata: the call that hands it over is not traced (not sampled)
INFER, REGISTER, UNREGISTER, STATUS, LOAD, UNLOAD, LOG, TRACE, STATS = range(9)  # ..., statistics
CUDA_REGISTER, CUDA_UNREGISTER, CUDA_STATUS = range(9, 12)  # CUDA shared memory regions
DISTRUST = 12  # an audit's verdict: a backend found computing wrongly on a device the workers share
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
    CUDA_REGISTER: pb.CudaSharedMemoryRegisterRequest,
    CUDA_UNREGISTER: pb.CudaSharedMemoryUnregisterRequest,
    CUDA_STATUS: pb.CudaSharedMemoryStatusRequest,
    DISTRUST: Struct,  # worker, version, backend, device, times, at (see verdict_of)
}
OWNERS = "owners"  # the folder, beside the sockets, where each live sequence names its owner
HELD = "held"  # the folder where a sequence no worker holds names the one that held it last
VERDICTS = (
    "distrusted"  # the folder where each backend an audit found wrong is named, with when: for workers started later
)
HELD_NAMES = 4096  # how many each worker keeps named: as many ids as a sequence store remembers
REGION_KEEPER = 0  # the worker that keeps the shared memory regions of all workers
ANSWER_HEAD = struct.Struct("!BI")  # status code (0: OK), then the response's bytes or the error message
CODES = {code.value[0]: code for code in grpc.StatusCode}

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def socket_path(directory: Path, index: int) -> Path:
    """Where worker `index` listens for steps handed over by the others."""
    return directory / f"worker-{index}.sock"


def owner_path(directory: Path, sequence_id: SequenceId, folder: str = OWNERS) -> Path:
    """Where the owner of `sequence_id` is named (1 and "1" are two sequences, as in the store), or
    in the folder HELD the worker that held it last."""
    key = f"{type(sequence_id).__name__}:{sequence_id}".encode()
    return directory / folder / hashlib.sha256(key).hexdigest()[:40]


def _named_owner(path: Path) -> int | None:
    try:
        return int(os.readlink(path))
    except FileNotFoundError:
        return None


class Handed(NamedTuple):
    """One handed-over request, as read."""

    kind: int
    body: bytes  # the request, as gRPC's message
    metadata: dict[str, str]  # its mha-sequence-id header; the id and the trace of the call that handed it over
    seconds: float | None  # left before its deadline

    @property
    def header(self) -> str | None:
        return self.metadata.get(SEQUENCE_HEADER)

    @property
    def request_id(self) -> str:
        """The id of the call that handed it over: the lines both workers log of it share it."""
        return self.metadata.get(REQUEST_ID, "")

    @property
    def traced(self) -> bool:
        """Whether it may be traced: the call that handed it over was, or tracing is off there."""
        return UNTRACED not in self.metadata


async def read_request(reader: asyncio.StreamReader) -> Handed:
    """One handed-over request, read from a peer's connection."""
    kind, size, metadata_size, seconds = REQUEST_HEAD.unpack(await reader.readexactly(REQUEST_HEAD.size))
    rest = await reader.readexactly(metadata_size + size)  # the metadata, then the request
    metadata = json.loads(rest[:metadata_size]) if metadata_size else {}
    return Handed(kind, rest[metadata_size:], metadata, seconds if seconds >= 0 else None)


def handed_metadata(header: str | None) -> bytes:
    """What a hand-over carries beside the request: its mha-sequence-id header, and the id and
    the trace context (W3C traceparent, where the call is traced) of the call handing it over."""
    metadata = {REQUEST_ID: request_id_var.get()}
    if header is not None:
        metadata[SEQUENCE_HEADER] = header
    if not pass_trace_on(metadata):
        metadata[UNTRACED] = "1"
    return json.dumps(metadata).encode()


def answer_frame(code: grpc.StatusCode, body: bytes) -> bytes:
    return ANSWER_HEAD.pack(code.value[0], len(body)) + body


class WorkerPeers:
    """This worker's view of the others: who owns a sequence, and connections to each owner."""

    def __init__(self, index: int, workers: int, directory: Path) -> None:
        """The sequences a previous life of this worker owned are gone with it: their names go."""
        self.index, self.workers, self.directory = index, workers, directory
        self._idle: dict[int, list[Connection]] = {}
        self._all_listening = False
        self._mine: set[SequenceId] = set()  # the sequences this worker owns
        self._held: OrderedDict[SequenceId, None] = OrderedDict()  # those it is named as the last holder of
        (directory / VERDICTS).mkdir(exist_ok=True)
        for folder in (OWNERS, HELD):
            (directory / folder).mkdir(exist_ok=True)
            for entry in os.scandir(directory / folder):
                self.release_path(Path(entry.path))

    def owner(self, sequence_id: SequenceId, start: bool) -> int | None:
        """The owner of `sequence_id` when it is another worker; None when it is this one, or when
        no worker holds it: a first step (`start`) makes this worker its owner, unless another
        worker did so first; any other step goes to the worker that held it last, which says what
        became of it, or is answered here (the sequence is not known)."""
        if sequence_id in self._mine:
            return None
        path = owner_path(self.directory, sequence_id)
        owner = _named_owner(path)
        while owner is None and start:
            try:
                os.symlink(str(self.index), path)  # atomic: of two workers, one names itself
                self._mine.add(sequence_id)
                return None
            except FileExistsError:
                owner = _named_owner(path)
        if owner is None:  # nobody holds it now
            owner = _named_owner(owner_path(self.directory, sequence_id, HELD))
        return None if owner in (None, self.index) else owner

    def release(self, sequence_id: SequenceId) -> None:
        """This worker keeps `sequence_id` no longer (ended, evicted, or its first step refused):
        it owns it no longer, and is named as the worker that held it last."""
        if sequence_id in self._mine:
            self._mine.discard(sequence_id)
            self._name_holder(sequence_id)
        self.release_path(owner_path(self.directory, sequence_id))

    def _name_holder(self, sequence_id: SequenceId) -> None:
        """Name this worker as the last holder of `sequence_id` (in place of any other: a link made
        aside and renamed over), forgetting the oldest it named beyond HELD_NAMES."""
        path = owner_path(self.directory, sequence_id, HELD)
        aside = path.with_name(f"{path.name}.{self.index}")
        aside.unlink(missing_ok=True)
        os.symlink(str(self.index), aside)
        os.replace(aside, path)
        self._held[sequence_id] = None
        self._held.move_to_end(sequence_id)
        while len(self._held) > HELD_NAMES:
            self.release_path(owner_path(self.directory, self._held.popitem(last=False)[0], HELD))

    def release_path(self, path: Path) -> None:
        if _named_owner(path) == self.index:
            path.unlink(missing_ok=True)  # only its owner removes a name: nobody else made it since

    def verdicts(self) -> list[Verdict]:
        """What the workers' audits found wrong, for a worker that started since: each backend's
        latest verdict (its count, and how long ago, say what is left of its cool-down)."""
        found = []
        for entry in os.scandir(self.directory / VERDICTS):
            if entry.name.endswith(".new"):  # being written: its name follows
                continue
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not a verdict after all
                found.append(verdict_of(json.loads(Path(entry.path).read_text())))
        return found

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
        body, metadata = request.SerializeToString(), handed_metadata(header)
        seconds = -1.0 if timeout is None else timeout
        frame = REQUEST_HEAD.pack(kind, len(body), len(metadata), seconds) + metadata + body
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


class Broadcast:
    """What a worker tells every other one without waiting for their answers (on the event loop):
    a worker that cannot be reached, or refuses, is logged."""

    def __init__(self, peers: WorkerPeers) -> None:
        self._peers = peers
        self._telling: set[asyncio.Task[None]] = set()  # what is being told: held until it is

    def distrust(self, version: str, backend: str, device: str, times: int) -> None:
        """This worker's audit found `backend` of `version` computing wrongly on `device`, its
        `times`-th time: the others are told, and the verdict named for a worker that starts later."""
        fields: dict[str, str | float] = {
            "worker": self._peers.index,
            "version": version,
            "backend": backend,
            "device": device,
            "times": times,
            "at": time.time(),  # the workers share a host, and so a clock
        }
        verdict = Struct()
        verdict.update(fields)
        for worker in self._peers.others:
            task = asyncio.get_running_loop().create_task(self._tell(worker, DISTRUST, verdict))
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)
        try:
            self._name(fields)
        except OSError as exc:  # the workers running now were told: only a later one will not know
            log.warning("an audit's verdict could not be named for workers started later: %s", exc)

    def _name(self, fields: dict[str, str | float]) -> None:
        """The verdict named in VERDICTS (written aside, then renamed over)."""
        key = "/".join(str(fields[k]) for k in ("version", "backend", "device"))
        path = self._peers.directory / VERDICTS / hashlib.sha256(key.encode()).hexdigest()[:40]
        aside = path.with_suffix(".new")
        aside.write_text(json.dumps(fields))
        aside.replace(path)

    async def _tell(self, worker: int, kind: int, request: Message) -> None:
        try:
            await self._peers.call(worker, kind, request)
        except Exception as exc:  # the teller goes on: the log says who was not told
            log.warning("worker %d was not told of an audit's verdict: %s", worker, exc)


def verdict_of(fields: Mapping[str, Any]) -> Verdict:
    """A verdict as `Broadcast` tells it and names it; KeyError, ValueError or TypeError if it is not one."""
    by, times = f"worker {int(fields['worker'])}", int(fields["times"])
    ago_s = max(0.0, time.time() - float(fields["at"]))
    return Verdict(str(fields["version"]), str(fields["backend"]), str(fields["device"]), by, times, ago_s)


def _unreachable(worker: int, exc: BaseException) -> str:
    return (
        f"worker {worker} of this replica, which holds this sequence or the shared memory regions, is not "
        f"reachable ({type(exc).__name__}); retry shortly"
    )
