"""System shared memory regions as every client sees them, whichever worker its connection
reaches: with `--workers N` one worker keeps them all (REGION_KEEPER), and the others hand it the
registrations, the status requests and every inference request that names a region, so that a
region registered through any connection is usable through every connection, and Status and
Unregister see one set. With one worker, this worker keeps its own."""

from __future__ import annotations

from service.proto import grpc_service_pb2 as pb
from service.protocol.peers import REGISTER, STATUS, UNREGISTER, WorkerPeers
from service.protocol.shm import Region, SystemRegions


class RegionDirectory:
    def __init__(self, local: SystemRegions, peers: WorkerPeers | None = None) -> None:
        self.local = local
        keeper = None if peers is None else peers.region_keeper
        self._keeper = None if peers is None or keeper is None else (peers, keeper)  # None: kept here

    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if self._keeper is None:
            self.local.register(name, key, offset, byte_size)
            return
        peers, keeper = self._keeper
        request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=byte_size)
        await peers.call(keeper, REGISTER, request)

    async def unregister(self, name: str) -> None:
        if self._keeper is None:
            self.local.unregister(name)
            return
        peers, keeper = self._keeper
        await peers.call(keeper, UNREGISTER, pb.SystemSharedMemoryUnregisterRequest(name=name))

    async def status(self, name: str) -> list[Region]:
        """The regions named `name`, or all of them for an empty name (fd -1: kept by another worker)."""
        if self._keeper is None:
            return self.local.status(name)
        peers, keeper = self._keeper
        answer = await peers.call(keeper, STATUS, pb.SystemSharedMemoryStatusRequest(name=name))
        regions = pb.SystemSharedMemoryStatusResponse.FromString(answer).regions.values()
        return [Region(r.name, r.key, int(r.offset), int(r.byte_size), -1) for r in regions]
