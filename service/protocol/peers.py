"""The other workers of one server (`--workers N`): each sequence has one owner worker, and a
step that reaches another worker is handed to its owner over a Unix-domain socket.

SO_REUSEPORT spreads connections, not sequences, over the workers: a client that reconnects
between steps (curl, most HTTP clients, a channel that reconnects) lands on any of them. A
sequence's state lives in one process only, its owner's, chosen from the sequence id alone
(crc32, the same in every process and every restart), so every connection reaches it. The
owner answers the forwarded request as it would its own; its status and message come back as
they are.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import grpc

from service.decode.control import SequenceId
from service.errors import NotReady, Relayed
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.codec import SEQUENCE_HEADER

log = logging.getLogger(__name__)

FORWARDED_METHOD = "ForwardedStep"  # the owner's metric label for steps handed over by another worker


def socket_path(directory: Path, index: int) -> Path:
    """Where worker `index` listens for steps handed over by the others."""
    return directory / f"worker-{index}.sock"


def owner_of(sequence_id: SequenceId, workers: int) -> int:
    """The worker that holds `sequence_id`'s state: the same answer in every process."""
    return zlib.crc32(str(sequence_id).encode()) % workers


class WorkerPeers:
    """This worker's view of the others: who owns a sequence, and a channel to each owner."""

    def __init__(
        self, index: int, workers: int, directory: Path, token: str | None = None, max_message_mb: int = 64
    ) -> None:
        self.index, self.workers, self.directory = index, workers, directory
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        limit = max_message_mb * 1024 * 1024
        self._options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self._stubs: dict[int, tuple[grpc.aio.Channel, pb_grpc.GRPCInferenceServiceStub]] = {}

    def owner(self, sequence_id: SequenceId) -> int | None:
        """The owner of `sequence_id` when it is another worker; None when it is this one."""
        owner = owner_of(sequence_id, self.workers)
        return None if owner == self.index else owner

    def _stub(self, worker: int) -> pb_grpc.GRPCInferenceServiceStub:
        if worker not in self._stubs:
            channel = grpc.aio.insecure_channel(f"unix:{socket_path(self.directory, worker)}", options=self._options)
            self._stubs[worker] = (channel, pb_grpc.GRPCInferenceServiceStub(channel))
        return self._stubs[worker][1]

    async def forward(
        self, worker: int, request: pb.ModelInferRequest, header: str | None, timeout: float | None
    ) -> pb.ModelInferResponse:
        """The owner's answer to `request`; its error status raised as Relayed, and an owner that
        cannot be reached (restarting, draining) as NotReady: the client retries."""
        metadata = (*self._metadata, *(((SEQUENCE_HEADER, header),) if header is not None else ()))
        try:
            response: pb.ModelInferResponse = await self._stub(worker).ModelInfer(
                request, timeout=timeout, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise NotReady(
                    f"worker {worker} of this replica, which holds this sequence, is not reachable ({exc.details()}); "
                    "retry shortly"
                ) from exc
            raise Relayed(exc.code().name, exc.details() or "") from exc
        return response

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
