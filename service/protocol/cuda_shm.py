"""CUDA shared memory regions, Triton's extension: a client on the same host allocates device
memory, sends its CUDA IPC handle (cudaIpcGetMemHandle's 64 bytes) under a name, then names the
region in a request instead of sending the tensor's bytes.

The server opens each handle once (cudaIpcOpenMemHandle) and copies a request's input from the
region to host memory, and its output back, on a stream of its own: the engine batches requests
of any transport together, so the region's bytes meet the others' in host memory either way.
The CUDA runtime is reached through cuda-python (`cuda.bindings.runtime`), imported when CUDA
shared memory is turned on; a server without a CUDA device refuses registrations and says why.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.errors import FeatureOff, InvalidInput, RegionNotFound, quote

log = logging.getLogger(__name__)

HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: a cudaIpcMemHandle_t


@dataclass(frozen=True)
class CudaRegion:
    """A registered region: `byte_size` bytes of device `device_id`'s memory at `pointer` (this
    process's address of the client's allocation)."""

    name: str
    device_id: int
    byte_size: int
    pointer: int


class CudaRuntime:
    """The few CUDA runtime calls the regions need, each checked: open and close an IPC handle,
    copy between a region and host memory (on one non-blocking stream per device, synchronized
    before the call returns)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver, runtime
        except ImportError as exc:
            raise FeatureOff(
                "CUDA shared memory needs cuda-python (`pip install mha-serve[gpu]`), which this server lacks; "
                "register a system shared memory region or send the tensor in the request"
            ) from exc
        self._rt: Any = runtime
        self._driver: Any = driver
        count, reason = self._devices()
        if not count:
            raise FeatureOff(
                f"CUDA shared memory needs a CUDA device on the server, and this one has none ({reason}); register "
                "a system shared memory region or send the tensor in the request"
            )
        self.device_count = count
        self._streams: dict[int, Any] = {}

    def _devices(self) -> tuple[int, str]:
        """How many CUDA devices this process sees, and why none when it sees none."""
        try:
            error, count = self._rt.cudaGetDeviceCount()
        except Exception as exc:  # cuda-python raises when it finds no CUDA library to load at all
            return 0, f"{type(exc).__name__}: {str(exc)[:200]}"
        if error != self._rt.cudaError_t.cudaSuccess:
            return 0, self._name(error)
        return int(count), "no device"

    def _call(self, function: Any, what: str, *args: Any) -> Any:
        result = function(*args)
        error, values = result[0], result[1:]
        if error != self._rt.cudaError_t.cudaSuccess:
            raise InvalidInput(f"could not {what}: CUDA error {self._name(error)}")
        return values[0] if len(values) == 1 else None

    def _name(self, error: Any) -> str:
        _, name = self._rt.cudaGetErrorName(error)
        return bytes(name).decode(errors="replace")

    def open(self, raw_handle: bytes, device_id: int) -> tuple[int, int]:
        """This process's address of the allocation `raw_handle` names on `device_id`, and the
        allocation's size in bytes (what the region may span, whatever its registration says)."""
        rt = self._rt
        handle = rt.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw_handle, HANDLE_BYTES)
        self._call(rt.cudaSetDevice, f"select CUDA device {device_id}", device_id)
        pointer = int(
            self._call(rt.cudaIpcOpenMemHandle, "open the CUDA IPC handle", handle, rt.cudaIpcMemLazyEnablePeerAccess)
        )
        error, _, size = self._driver.cuMemGetAddressRange(pointer)
        if error != self._driver.CUresult.CUDA_SUCCESS:
            self._call(rt.cudaIpcCloseMemHandle, "close the CUDA IPC handle", pointer)
            _, name = self._driver.cuGetErrorName(error)
            raise InvalidInput(f"could not find the allocation the CUDA IPC handle names: {bytes(name).decode()}")
        return pointer, int(size)

    def close(self, region: CudaRegion) -> None:
        self._call(self._rt.cudaSetDevice, f"select CUDA device {region.device_id}", region.device_id)
        self._call(self._rt.cudaIpcCloseMemHandle, "close the CUDA IPC handle", region.pointer)

    def copy(self, region: CudaRegion, offset: int, host: np.ndarray, to_host: bool) -> None:
        """`host.nbytes` bytes between `host` (C-contiguous) and the region at `offset`."""
        rt = self._rt
        stream = self._stream(region.device_id)
        device = region.pointer + offset
        source, target = (device, host.ctypes.data) if to_host else (host.ctypes.data, device)
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost if to_host else rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        what = f"copy {host.nbytes} bytes {'from' if to_host else 'to'} CUDA region {region.name[:64]!r}"
        self._call(rt.cudaMemcpyAsync, what, target, source, host.nbytes, kind, stream)
        self._call(rt.cudaStreamSynchronize, what, stream)

    def _stream(self, device_id: int) -> Any:
        if (stream := self._streams.get(device_id)) is None:
            rt = self._rt
            self._call(rt.cudaSetDevice, f"select CUDA device {device_id}", device_id)
            stream = self._call(rt.cudaStreamCreateWithFlags, "create a CUDA stream", rt.cudaStreamNonBlocking)
            self._streams[device_id] = stream
        return stream


class CudaRegions:
    """The registered CUDA regions of this process, by name (the names checked by the caller,
    which holds the system regions' names too)."""

    def __init__(self, enabled: bool, off_message: str, runtime: CudaRuntime | None = None) -> None:
        self.enabled, self.off_message = enabled, off_message
        self._regions: dict[str, CudaRegion] = {}
        self._runtime = runtime  # None: started by the first registration

    def __contains__(self, name: str) -> bool:
        return name in self._regions

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        if len(raw_handle) != HANDLE_BYTES or byte_size <= 0 or device_id < 0:
            raise InvalidInput(
                f"CUDA region {quote(name)}: raw_handle of {len(raw_handle)} bytes, device_id {device_id}, "
                f"byte_size {byte_size}; expected a {HANDLE_BYTES}-byte cudaIpcMemHandle_t, a device id >= 0 "
                "and a positive size"
            )
        runtime = self._runtime = self._runtime or CudaRuntime()
        if device_id >= runtime.device_count:
            raise InvalidInput(
                f"CUDA region {quote(name)}: device_id {device_id}; this server has {runtime.device_count} device(s)"
            )
        pointer, size = runtime.open(raw_handle, device_id)
        region = CudaRegion(name, device_id, byte_size, pointer)
        if byte_size > size:  # a region past its allocation would reach other memory of this process
            runtime.close(region)
            raise InvalidInput(
                f"CUDA region {quote(name)}: byte_size {byte_size} exceeds the {size} bytes of the allocation its "
                "handle names"
            )
        self._regions[name] = region
        log.info("registered CUDA shared memory region %s (device %d, %d bytes)", quote(name), device_id, byte_size)

    def unregister(self, name: str) -> None:
        """Close region `name`; an empty name closes every one. Unknown names are not an error."""
        self._check_on()
        self._close(list(self._regions) if name == "" else [name])

    def close(self) -> None:
        self._close(list(self._regions))

    def _close(self, names: list[str]) -> None:
        for region in [self._regions.pop(name) for name in names if name in self._regions]:
            assert self._runtime is not None  # it opened the region
            self._runtime.close(region)

    def status(self, name: str) -> list[CudaRegion]:
        """The regions named `name`, or all of them for an empty name."""
        self._check_on()
        if name == "":
            return list(self._regions.values())
        if name not in self._regions:
            raise RegionNotFound(f"no CUDA shared memory region named {quote(name)} is registered on this server")
        return [self._regions[name]]

    def copy(self, name: str, offset: int, host: np.ndarray, to_host: bool) -> None:
        """`host.nbytes` bytes between `host` and region `name` at `offset`, checked against the
        region as registered."""
        region = self.check(name, offset, host.nbytes)
        assert self._runtime is not None  # it opened the region
        self._runtime.copy(region, offset, host, to_host)

    def _check_on(self) -> None:
        if not self.enabled:
            raise FeatureOff(self.off_message)

    def check(self, name: str, offset: int, nbytes: int) -> CudaRegion:
        region = self._regions[name]
        if offset + nbytes > region.byte_size:
            raise InvalidInput(
                f"CUDA region {quote(name)}: offset {offset} + {nbytes} bytes exceeds its registered "
                f"byte_size {region.byte_size}"
            )
        return region
