"""Shared memory regions, Triton's extensions: a client on the same host registers a POSIX
shared memory object (`/dev/shm/<key>`), or device memory by its CUDA IPC handle (cuda_shm.py),
under a name, then names it in a request instead of sending the tensor's bytes. One name space
holds both kinds, as Triton's does.

The server never maps a system region: it holds an open descriptor and reads and writes with
pread/pwrite after checking the object's current size, so a region that its owner truncates
or unlinks gives a clean error instead of SIGBUS. Every call runs on the event loop's thread;
a lookup and the read or write that follows it happen with no await between them.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import FeatureOff, InvalidInput, Overloaded, RegionExists, RegionNotFound, quote
from service.protocol.cuda_shm import CudaRegions

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
KEY_PATTERN = re.compile(r"/*([A-Za-z0-9._-]{1,255})")  # a POSIX shm name: one component, no slashes inside
NAME_LIMIT = 128
OFF_MESSAGE = (
    "shared memory is turned off on this server (--shared-memory off); send the tensor in the "
    "request, or start the server with --shared-memory system (or cuda, or system,cuda)"
)
SYSTEM_OFF = (
    "system shared memory is turned off on this server; send the tensor in the request, or start the "
    "server with --shared-memory system (or system,cuda)"
)
CUDA_OFF = (
    "CUDA shared memory is turned off on this server; register a system shared memory region, send the "
    "tensor in the request, or start the server with --shared-memory cuda (or system,cuda)"
)


@dataclass(frozen=True)
class Region:
    """A registered region: `byte_size` bytes at `offset` of the shared memory object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int

    def described(self) -> dict[str, str | int]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass(frozen=True)
class RegionSlice:
    """Where a request's tensor lives: `byte_size` bytes at `offset` inside region `region`."""

    region: str
    byte_size: int
    offset: int


class Regions:
    """The registered regions of this process, of both kinds, by name."""

    def __init__(self, system: bool, max_regions: int, directory: Path = SHM_DIR, cuda: bool = False) -> None:
        self.system, self.max_regions, self.directory = system, max_regions, directory
        self.enabled = system or cuda
        self._regions: dict[str, Region] = {}
        self.cuda = CudaRegions(cuda, CUDA_OFF)  # Status and Unregister of CUDA regions go to it directly

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_room(name, self.system, SYSTEM_OFF)
        if byte_size <= 0 or offset < 0:
            raise InvalidInput(
                f"region {quote(name)}: offset {offset}, byte_size {byte_size}; "
                "expected offset >= 0 and a positive size"
            )
        fd = _open_object(self.directory, key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(
                    f"region {quote(name)}: offset {offset} + byte_size {byte_size} exceeds the {size} bytes "
                    f"of shared memory object {quote(key)}"
                )
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)
        log.info("registered shared memory region %s (key %s, %d bytes)", quote(name), quote(key), byte_size)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the client's CUDA IPC handle: `byte_size` bytes of device `device_id`'s memory."""
        self._check_room(name, self.cuda.enabled, CUDA_OFF)
        self.cuda.register(name, raw_handle, device_id, byte_size)

    def unregister(self, name: str) -> None:
        """Forget system region `name`; an empty name forgets every one. Unknown names are not an
        error (as Triton)."""
        self._check_on(self.system, SYSTEM_OFF)
        self._forget(list(self._regions) if name == "" else [name])

    def status(self, name: str) -> list[Region]:
        """The system regions named `name`, or all of them for an empty name."""
        self._check_on(self.system, SYSTEM_OFF)
        if name == "":
            return list(self._regions.values())
        return [self._lookup(name)]

    def check(self, where: RegionSlice, nbytes: int) -> None:
        """Refuse an access of `nbytes` at `where` that the region or its object cannot hold."""
        if where.region in self.cuda:
            self.cuda.check(where.region, where.offset, nbytes)
        else:
            self._bounds(where, nbytes)

    def read(self, where: RegionSlice, out: np.ndarray) -> None:
        """Fill `out` (C-contiguous) with the slice's bytes."""
        if where.region in self.cuda:
            return self.cuda.copy(where.region, where.offset, out, to_host=True)
        region, start = self._bounds(where, out.nbytes)
        try:
            got = os.preadv(region.fd, [out.data.cast("B")], start)
        except OSError as exc:
            raise InvalidInput(f"region {quote(region.name)}: its object cannot be read: {exc.strerror}") from None
        if got != out.nbytes:
            raise InvalidInput(f"region {quote(region.name)}: read {got} of {out.nbytes} bytes; its object shrank")

    def write(self, where: RegionSlice, data: np.ndarray) -> None:
        """Write `data` at the slice, all of it or an error that names the region: the
        object's file may refuse bytes (the host's shared memory is full: tmpfs allocates pages
        on the first write; a file size limit), and an answer with part of its output would be
        a silent wrong answer."""
        if where.region in self.cuda:
            return self.cuda.copy(where.region, where.offset, np.ascontiguousarray(data), to_host=False)
        region, start = self._bounds(where, data.nbytes)
        try:
            wrote = os.pwrite(region.fd, np.ascontiguousarray(data).data.cast("B"), start)
        except OSError as exc:
            raise Overloaded(
                f"region {quote(region.name)}: the output could not be written to its object {quote(region.key)}: "
                f"{exc.strerror}; free shared memory on the host, or receive the output in the response"
            ) from None
        if wrote != data.nbytes:
            raise Overloaded(
                f"region {quote(region.name)}: its object {quote(region.key)} took {wrote} of the output's "
                f"{data.nbytes} bytes (the host's shared memory is full, or a file size limit); free shared "
                "memory, or receive the output in the response"
            )

    def close(self) -> None:
        self._forget(list(self._regions))
        self.cuda.close()

    def _forget(self, names: list[str]) -> None:
        for name in names:
            region = self._regions.pop(name, None)
            if region is not None:
                os.close(region.fd)

    def _check_on(self, on: bool, message: str) -> None:
        if not on:
            raise FeatureOff(message)

    def _check_room(self, name: str, on: bool, message: str) -> None:
        """A new region's name is free in both kinds, and the server holds fewer than its limit."""
        self._check_on(on, message)
        if not name or len(name) > NAME_LIMIT:
            raise InvalidInput(f"region name {quote(name)}: expected 1 to {NAME_LIMIT} characters")
        if name in self._regions or name in self.cuda:
            raise RegionExists(f"a shared memory region named {quote(name)} is already registered; unregister it first")
        if len(self._regions) + len(self.cuda) >= self.max_regions:
            raise Overloaded(
                f"this server holds its limit of {self.max_regions} shared memory regions; unregister one first"
            )

    def _lookup(self, name: str) -> Region:
        self._check_on(self.enabled, OFF_MESSAGE)
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"no shared memory region named {quote(name)} is registered on this server")
        return region

    def _bounds(self, where: RegionSlice, nbytes: int) -> tuple[Region, int]:
        """The region and the object offset of an access of `nbytes`, checked against the region
        as registered and against the object's size now."""
        region = self._lookup(where.region)
        if where.offset + nbytes > region.byte_size:
            raise InvalidInput(
                f"region {quote(region.name)}: offset {where.offset} + {nbytes} bytes exceeds its registered "
                f"byte_size {region.byte_size}"
            )
        start = region.offset + where.offset
        try:
            size = os.fstat(region.fd).st_size
        except OSError as exc:
            raise InvalidInput(f"region {quote(region.name)}: its object cannot be examined: {exc.strerror}") from None
        if start + nbytes > size:
            raise InvalidInput(
                f"region {quote(region.name)}: its object {quote(region.key)} is now {size} bytes, too small for "
                f"{nbytes} bytes at {start}; its owner truncated it: re-register the region"
            )
        return region, start


def _open_object(directory: Path, key: str) -> int:
    """A descriptor of shared memory object `key`, opened for reading and writing."""
    match = KEY_PATTERN.fullmatch(key)
    if match is None or match.group(1) in (".", ".."):
        raise InvalidInput(
            f"shared memory key {quote(key)} is not a POSIX shared memory name; expected '/name' with "
            "letters, digits, '.', '_' or '-'"
        )
    try:
        fd = os.open(directory / match.group(1), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInput(f"no shared memory object {quote(key)} exists on this host") from None
    except OSError as exc:
        raise InvalidInput(f"cannot open shared memory object {quote(key)}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidInput(f"shared memory object {quote(key)} is not a regular shared memory object")
    return fd
