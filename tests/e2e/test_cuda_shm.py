"""CUDA shared memory on a GPU: a client process allocates device memory, registers its CUDA IPC
handle (over gRPC, and over HTTP as base64), and the server reads the input from it and writes
the output into it, as Triton's `tritonclient.utils.cuda_shared_memory` clients do (cudaMalloc,
cudaIpcGetMemHandle, the 64 raw bytes in CudaSharedMemoryRegister). Skipped without a CUDA
device (bench/gpu_run.sh runs it on one); the refusals without one are in
tests/service/protocol/test_shm.py."""

from __future__ import annotations

import base64
import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ServerProcess, http_raw

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_run.sh runs it)"),
]


def _ok(result: tuple[Any, ...]) -> Any:
    from cuda.bindings import runtime as rt

    assert result[0] == rt.cudaError_t.cudaSuccess, result[0]
    return result[1] if len(result) == 2 else result[1:]


class DeviceBuffer:
    """Device memory of this (client) process, shared by its CUDA IPC handle."""

    def __init__(self, nbytes: int) -> None:
        from cuda.bindings import runtime as rt

        self.rt, self.nbytes = rt, nbytes
        _ok(rt.cudaSetDevice(0))
        self.pointer = int(_ok(rt.cudaMalloc(nbytes)))
        handle = _ok(rt.cudaIpcGetMemHandle(self.pointer))
        self.raw_handle = bytes((ctypes.c_char * 64).from_address(handle.getPtr()))

    def put(self, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x)
        _ok(self.rt.cudaMemcpy(self.pointer, x.ctypes.data, x.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def get(self, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _ok(self.rt.cudaMemcpy(out.ctypes.data, self.pointer, out.nbytes, kind))
        return out

    def free(self) -> None:
        _ok(self.rt.cudaFree(self.pointer))


@pytest.fixture(params=["1", "2"], ids=["one-worker", "two-workers"])
def server(request: pytest.FixtureRequest, default_model_dir: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    args = ["--model-dir", str(default_model_dir), "--shared-memory", "system,cuda"]
    process = ServerProcess(args, workers=request.param).start(tmp_path / "server.log", ready_timeout=300)
    try:
        yield process
    finally:
        process.terminate()


def _shm_request(shape: tuple[int, ...], nbytes: int) -> pb.ModelInferRequest:
    request = encode_infer_request(np.zeros(shape, np.float32))
    request.ClearField("raw_input_contents")
    tensor = request.inputs[0]
    tensor.parameters["shared_memory_region"].string_param = "in"
    tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
    out = request.outputs.add(name="y")
    out.parameters["shared_memory_region"].string_param = "out"
    out.parameters["shared_memory_byte_size"].int64_param = nbytes
    return request


def test_a_request_reads_and_writes_cuda_regions_exactly(server: ServerProcess, default_model_dir: Path) -> None:
    config, weights = load_checkpoint(default_model_dir / "weights.safetensors")
    x = np.random.default_rng(7).standard_normal((2, 48, config.d_model), dtype=np.float32)
    source, target = DeviceBuffer(x.nbytes), DeviceBuffer(x.nbytes)
    try:
        source.put(x)
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            stub.CudaSharedMemoryRegister(
                pb.CudaSharedMemoryRegisterRequest(
                    name="in", raw_handle=source.raw_handle, device_id=0, byte_size=source.nbytes
                )
            )
            handle = {"b64": base64.b64encode(target.raw_handle).decode()}  # the output's, as tritonclient.http
            body = json.dumps({"raw_handle": handle, "device_id": 0, "byte_size": target.nbytes}).encode()
            assert http_raw(server.http_port, "/v2/cudasharedmemory/region/out/register", body) == (200, {})
            bogus = pb.CudaSharedMemoryRegisterRequest(name="bogus", raw_handle=b"\1" * 64, byte_size=x.nbytes)
            with pytest.raises(grpc.RpcError) as info:  # 64 bytes CUDA cannot open: the client's mistake
                stub.CudaSharedMemoryRegister(bogus)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            wide = pb.CudaSharedMemoryRegisterRequest(name="wide", raw_handle=source.raw_handle, byte_size=2**30)
            with pytest.raises(grpc.RpcError) as info:  # past its allocation: other memory of the server's
                stub.CudaSharedMemoryRegister(wide)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds the" in (info.value.details() or "")
            again = pb.CudaSharedMemoryRegisterRequest(name="in", raw_handle=source.raw_handle, byte_size=x.nbytes)
            with pytest.raises(grpc.RpcError) as info:  # one name space, as Triton's
                stub.CudaSharedMemoryRegister(again)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            status = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest())
            assert {n: (r.device_id, r.byte_size) for n, r in status.regions.items()} == {
                "in": (0, x.nbytes),
                "out": (0, x.nbytes),
            }
            response = stub.ModelInfer(_shm_request(x.shape, x.nbytes), timeout=60)
            assert not any(response.raw_output_contents), "the output went to the region, not the reply"
            y = target.get(x.shape)
            error = relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config))
            assert error < 1e-5, error
            with pytest.raises(grpc.RpcError) as info:  # a slice past the region's end
                stub.ModelInfer(_shm_request((4, 48, config.d_model), 2 * x.nbytes), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds its registered byte_size" in (info.value.details() or "")
            stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name=""))
            assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(_shm_request(x.shape, x.nbytes), timeout=60)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        source.free()
        target.free()
