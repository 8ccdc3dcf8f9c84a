"""Triton's system shared memory extension: regions registered over gRPC and HTTP, tensors read
from and written to them, every access bounds-checked, and regions that their owner truncates or
unlinks answered cleanly."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.errors import FeatureOff, InvalidInput, Overloaded, RegionExists, RegionNotFound
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request, request_from_proto
from service.protocol.inference import answered, output_slice
from service.protocol.shm import Regions, RegionSlice
from tests.service.protocol.test_codec import SPEC
from tests.support import ServerThread, http_raw, make_settings

C = 32


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    settings = make_settings(small_model_dir, backend="torch", shared_memory="system", max_shared_memory_regions=6)
    with ServerThread(settings) as s:
        yield s


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        yield stub
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name=""))


@pytest.fixture
def objects() -> Iterator[list[shared_memory.SharedMemory]]:
    """Shared memory objects a test creates; unlinked after it."""
    made: list[shared_memory.SharedMemory] = []
    yield made
    for shm in made:
        shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


def _object(objects: list[shared_memory.SharedMemory], size: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(create=True, size=size)
    objects.append(shm)
    return shm


def _key(shm: shared_memory.SharedMemory) -> str:
    return "/" + shm.name.lstrip("/")


def _register(stub: pb_grpc.GRPCInferenceServiceStub, name: str, key: str, byte_size: int, offset: int = 0) -> None:
    request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=byte_size)
    stub.SystemSharedMemoryRegister(request)


def _place(parameters: object, region: str, byte_size: int, offset: int = 0) -> None:
    parameters["shared_memory_region"].string_param = region  # type: ignore[index]
    parameters["shared_memory_byte_size"].int64_param = byte_size  # type: ignore[index]
    if offset:
        parameters["shared_memory_offset"].int64_param = offset  # type: ignore[index]


def _shm_request(shape: tuple[int, int, int], region: str, offset: int = 0, out: tuple[str, int] | None = None):
    request = pb.ModelInferRequest(model_name="mha")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(shape))
    _place(tensor.parameters, region, int(np.prod(shape)) * 4, offset)
    if out is not None:
        _place(request.outputs.add(name="y").parameters, out[0], int(np.prod(shape)) * 4, out[1])
    return request


def _reference(model_dir: Path, x: np.ndarray) -> torch.Tensor:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    return attention_view(torch.from_numpy(x), weights, config)


def _code(call, *args) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value.code(), info.value.details() or ""


def test_input_and_output_in_shared_memory_at_offsets(stub, objects, small_model_dir: Path) -> None:
    x = np.random.default_rng(1).standard_normal((2, 9, C), dtype=np.float32)
    inp, out = _object(objects, 64 + x.nbytes), _object(objects, 4096 + 2 * x.nbytes)
    np.ndarray(x.shape, np.float32, inp.buf, offset=64)[:] = x
    _register(stub, "in", _key(inp), byte_size=x.nbytes, offset=64)  # the region starts 64 bytes in
    _register(stub, "out", _key(out), byte_size=2 * x.nbytes, offset=4096)
    response = stub.ModelInfer(_shm_request(x.shape, "in", out=("out", x.nbytes)))
    assert list(response.raw_output_contents) == [b""], "the output went to shared memory: its entry is empty"
    params = response.outputs[0].parameters
    assert params["shared_memory_region"].string_param == "out"
    assert params["shared_memory_byte_size"].int64_param == x.nbytes
    assert list(response.outputs[0].shape) == list(x.shape)
    y = np.ndarray(x.shape, np.float32, out.buf, offset=4096 + x.nbytes).copy()
    assert relative_error(torch.from_numpy(y), _reference(small_model_dir, x)) < 1e-5
    assert not np.ndarray(x.shape, np.float32, out.buf, offset=4096).any(), "nothing written before the offset"


def test_input_in_shared_memory_output_in_the_reply(stub, objects, small_model_dir: Path) -> None:
    x = np.random.default_rng(2).standard_normal((1, 5, C), dtype=np.float32)
    inp = _object(objects, x.nbytes)
    np.ndarray(x.shape, np.float32, inp.buf)[:] = x
    _register(stub, "in", _key(inp), x.nbytes)
    response = stub.ModelInfer(_shm_request(x.shape, "in"))
    y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(x.shape).copy()
    assert relative_error(torch.from_numpy(y), _reference(small_model_dir, x)) < 1e-5


def test_status_register_and_unregister(stub, objects) -> None:
    a, b = _object(objects, 1024), _object(objects, 2048)
    _register(stub, "a", _key(a), 1000, offset=24)
    _register(stub, "b", _key(b), 2048)
    everything = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
    assert set(everything.regions) == {"a", "b"}
    one = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(name="a")).regions["a"]
    assert (one.key, one.offset, one.byte_size) == (_key(a), 24, 1000)
    code, message = _code(
        stub.SystemSharedMemoryRegister, pb.SystemSharedMemoryRegisterRequest(name="a", key=_key(b), byte_size=8)
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'a'" in message
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="a"))
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="never-registered"))
    code, _ = _code(stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest(name="a"))
    assert code == grpc.StatusCode.NOT_FOUND
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name=""))
    assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()).regions


def _bad_registrations(key: str) -> dict[str, tuple[pb.SystemSharedMemoryRegisterRequest, str]]:
    R = pb.SystemSharedMemoryRegisterRequest
    return {
        "past-the-object": (R(name="r", key=key, offset=1000, byte_size=100), "exceeds the 1024 bytes"),
        "zero-size": (R(name="r", key=key, byte_size=0), "positive size"),
        "no-such-object": (R(name="r", key="/mha-test-does-not-exist", byte_size=8), "no shared memory object"),
        "traversal": (R(name="r", key="/../../etc/passwd", byte_size=8), "not a POSIX shared memory name"),
        "inner-slash": (R(name="r", key="/a/b", byte_size=8), "not a POSIX shared memory name"),
        "dot-dot": (R(name="r", key="..", byte_size=8), "not a POSIX shared memory name"),
        "empty-name": (R(name="", key=key, byte_size=8), "expected 1 to 128 characters"),
        "long-name": (R(name="n" * 500, key=key, byte_size=8), "expected 1 to 128 characters"),
    }


def test_bad_registrations_are_invalid_argument(stub, objects) -> None:
    key = _key(_object(objects, 1024))
    for case, (request, expected) in _bad_registrations(key).items():
        code, message = _code(stub.SystemSharedMemoryRegister, request)
        assert (code, expected in message) == (grpc.StatusCode.INVALID_ARGUMENT, True), (case, message)
        assert len(message) < 400, case
    assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()).regions


def test_too_many_regions_is_resource_exhausted(stub, objects) -> None:
    key = _key(_object(objects, 64))
    for i in range(6):
        _register(stub, f"r{i}", key, 64)
    code, message = _code(
        stub.SystemSharedMemoryRegister, pb.SystemSharedMemoryRegisterRequest(name="r6", key=key, byte_size=64)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 6" in message


def _bad_requests(region: str, nbytes: int) -> dict[str, tuple[pb.ModelInferRequest, grpc.StatusCode, str]]:
    shape = (1, 4, C)  # nbytes = 512
    cases = {
        "unknown-region": (
            _shm_request(shape, "nope"),
            grpc.StatusCode.NOT_FOUND,
            "no shared memory region named 'nope'",
        ),
        "past-the-region": (
            _shm_request(shape, region, offset=nbytes - 4),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds its registered byte_size",
        ),
        "output-past-the-region": (
            _shm_request(shape, region, out=(region, nbytes - 8)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds its registered byte_size",
        ),
    }
    wrong_size = _shm_request(shape, region)
    wrong_size.inputs[0].parameters["shared_memory_byte_size"].int64_param = 500
    cases["wrong-size"] = (wrong_size, grpc.StatusCode.INVALID_ARGUMENT, "needs exactly 512 bytes")
    small_out = _shm_request(shape, region, out=(region, 0))
    small_out.outputs[0].parameters["shared_memory_byte_size"].int64_param = 100
    cases["output-too-small"] = (small_out, grpc.StatusCode.INVALID_ARGUMENT, "too small")
    text_size = _shm_request(shape, region)
    text_size.inputs[0].parameters["shared_memory_byte_size"].string_param = "512"
    cases["size-as-text"] = (text_size, grpc.StatusCode.INVALID_ARGUMENT, "must be an integer byte count")
    negative = _shm_request(shape, region)
    negative.inputs[0].parameters["shared_memory_offset"].int64_param = -8
    cases["negative-offset"] = (negative, grpc.StatusCode.INVALID_ARGUMENT, "expected a byte count >= 0")
    no_size = _shm_request(shape, region)
    del no_size.inputs[0].parameters["shared_memory_byte_size"]
    cases["no-size"] = (no_size, grpc.StatusCode.INVALID_ARGUMENT, "needs both")
    both = _shm_request(shape, region)
    both.raw_input_contents.append(bytes(512))
    cases["data-too"] = (both, grpc.StatusCode.INVALID_ARGUMENT, "also carries data")
    return cases


def test_every_bad_slice_is_refused_precisely(stub, objects, small_model_dir: Path) -> None:
    nbytes = 1024
    shm = _object(objects, nbytes)
    np.ndarray((nbytes // 4,), np.float32, shm.buf)[:] = 0.5
    _register(stub, "r", _key(shm), nbytes)
    for case, (request, expected_code, expected) in _bad_requests("r", nbytes).items():
        code, message = _code(stub.ModelInfer, request)
        assert (code, expected in message) == (expected_code, True), (case, code, message)
    x = np.random.default_rng(3).standard_normal((1, 3, C), dtype=np.float32)
    y = np.frombuffer(stub.ModelInfer(encode_infer_request(x)).raw_output_contents[0], np.float32)
    assert relative_error(torch.from_numpy(y.reshape(x.shape).copy()), _reference(small_model_dir, x)) < 1e-5


def test_an_object_truncated_or_unlinked_by_its_owner_does_not_hurt_the_server(stub, objects) -> None:
    x = np.ones((1, 4, C), np.float32)
    shm = _object(objects, x.nbytes)
    np.ndarray(x.shape, np.float32, shm.buf)[:] = x
    _register(stub, "r", _key(shm), x.nbytes)
    shm.unlink()  # the name is gone; the server's open descriptor keeps the object
    assert stub.ModelInfer(_shm_request(x.shape, "r")).raw_output_contents
    small = _object(objects, x.nbytes)
    np.ndarray(x.shape, np.float32, small.buf)[:] = x
    _register(stub, "s", _key(small), x.nbytes)
    os.truncate(f"/dev/shm/{small.name.lstrip('/')}", 16)  # the owner shrinks it under the server
    code, message = _code(stub.ModelInfer, _shm_request(x.shape, "s"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in message
    assert stub.ModelInfer(encode_infer_request(x)).raw_output_contents, "the server still serves"


def test_cuda_shared_memory_turned_off_says_how_to_turn_it_on(stub) -> None:
    request = pb.CudaSharedMemoryRegisterRequest(name="g", raw_handle=b"\0" * 64, device_id=0, byte_size=64)
    code, message = _code(stub.CudaSharedMemoryRegister, request)
    assert code == grpc.StatusCode.UNIMPLEMENTED and "--shared-memory cuda" in message
    code, _ = _code(stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest())
    assert code == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a server without a CUDA device")
def test_cuda_shared_memory_on_a_server_without_a_device(small_model_dir: Path, objects) -> None:
    """Turned on where no CUDA device is: a well-formed registration is refused with why, a
    malformed one with what was wrong, names are shared with system regions, and nothing is
    left registered. (The regions' reads and writes: tests/e2e/test_cuda_shm.py, on a GPU.)"""
    settings = make_settings(small_model_dir, backend="torch", shared_memory="system,cuda", http_port=0)
    with ServerThread(settings) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        meta = stub.ServerMetadata(pb.ServerMetadataRequest())
        assert {"system_shared_memory", "cuda_shared_memory"} <= set(meta.extensions)

        def register(name: str, handle: bytes = b"\1" * 64, device: int = 0, size: int = 64) -> tuple:
            request = pb.CudaSharedMemoryRegisterRequest(name=name, raw_handle=handle, device_id=device, byte_size=size)
            return _code(stub.CudaSharedMemoryRegister, request)

        code, message = register("g")
        assert code == grpc.StatusCode.UNIMPLEMENTED and "has none" in message, message
        for bad in (dict(handle=b"\1" * 63), dict(size=0), dict(device=-1), dict(handle=b"")):
            code, message = register("g", **bad)  # type: ignore[arg-type]
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "64-byte cudaIpcMemHandle_t" in message, message
        code, _ = register("x" * 129)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        shm = _object(objects, 64)
        _register(stub, "taken", _key(shm), 64)
        code, message = register("taken")  # one name space for both kinds, as Triton's
        assert code == grpc.StatusCode.ALREADY_EXISTS and "taken" in message
        assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
        code, _ = _code(stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name="g"))
        assert code == grpc.StatusCode.NOT_FOUND
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="g"))  # unknown: not an error
        assert list(stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()).regions) == ["taken"]
        # Triton's HTTP endpoints, the handle as {"b64": ...}
        register = "/v2/cudasharedmemory/region/g/register"
        handle = base64.b64encode(b"\1" * 64).decode()
        bad = {b"[]": "JSON object", b'{"raw_handle": "AAAA", "byte_size": 64}': "raw_handle"}
        bad[b'{"raw_handle": {"b64": "%%"}, "byte_size": 64}'] = "raw_handle"
        for body, why in bad.items():
            code, answer = http_raw(server.http_port, register, body)
            assert code == 400 and why in answer["error"], (body, answer)
        body = json.dumps({"raw_handle": {"b64": base64.b64encode(b"\1" * 8).decode()}, "byte_size": 64}).encode()
        code, answer = http_raw(server.http_port, register, body)
        assert code == 400 and "64-byte cudaIpcMemHandle_t" in answer["error"], answer
        body = json.dumps({"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 64}).encode()
        code, answer = http_raw(server.http_port, register, body)
        assert code == 501 and "has none" in answer["error"], (code, answer)
        assert http_raw(server.http_port, "/v2/cudasharedmemory/status") == (200, [])
        assert http_raw(server.http_port, "/v2/cudasharedmemory/region/g/unregister", b"")[0] == 200


def test_turned_off_by_default(small_model_dir: Path, objects) -> None:
    shm = _object(objects, 512)
    with (
        ServerThread(make_settings(small_model_dir, backend="torch")) as off,
        grpc.insecure_channel(off.url) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.SystemSharedMemoryRegisterRequest(name="r", key=_key(shm), byte_size=512)
        code, message = _code(stub.SystemSharedMemoryRegister, request)
        assert code == grpc.StatusCode.UNIMPLEMENTED and "--shared-memory system" in message
        code, message = _code(stub.ModelInfer, _shm_request((1, 4, C), "r"))
        assert code == grpc.StatusCode.UNIMPLEMENTED and "--shared-memory off" in message


# The region arithmetic, as a property: a read succeeds exactly when it fits the region as
# registered and the object as it is now, and then returns the object's bytes.
@settings(max_examples=200, deadline=None)
@given(
    object_size=st.integers(1, 4096),
    region_offset=st.integers(0, 4096),
    region_size=st.integers(1, 4096),
    offset=st.integers(0, 4096),
    count=st.integers(1, 512),
    shrink_to=st.one_of(st.none(), st.integers(0, 4096)),
)
def test_region_bounds(tmp_path_factory, object_size, region_offset, region_size, offset, count, shrink_to) -> None:
    directory = tmp_path_factory.mktemp("shm")
    data = np.random.default_rng(object_size).integers(0, 256, object_size, dtype=np.uint8)
    (directory / "obj").write_bytes(data.tobytes())
    regions = Regions(True, 4, directory)
    try:
        regions.register("r", "/obj", region_offset, region_size)
    except InvalidInput:
        assert region_offset + region_size > object_size
        return
    if shrink_to is not None:
        os.truncate(directory / "obj", min(shrink_to, object_size))
    size_now = object_size if shrink_to is None else min(shrink_to, object_size)
    out = np.empty(count, np.uint8)
    fits = offset + count <= region_size and region_offset + offset + count <= size_now
    try:
        regions.read(RegionSlice("r", count, offset), out)
    except InvalidInput:
        assert not fits
    else:
        assert fits and np.array_equal(out, data[region_offset + offset : region_offset + offset + count])
    finally:
        regions.close()


def test_registry_errors_are_domain_errors(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(bytes(64))
    regions = Regions(True, 1, tmp_path)
    regions.register("a", "obj", 0, 64)
    with pytest.raises(RegionExists):
        regions.register("a", "obj", 0, 64)
    with pytest.raises(Overloaded):
        regions.register("b", "obj", 0, 64)
    with pytest.raises(RegionNotFound):
        regions.status("b")
    os.symlink(tmp_path / "obj", tmp_path / "link")
    regions.unregister("")
    with pytest.raises(InvalidInput, match="cannot open"):
        regions.register("l", "/link", 0, 8)  # symbolic links are not followed
    with pytest.raises(FeatureOff):
        Regions(False, 1, tmp_path).register("a", "obj", 0, 64)


def test_a_region_unregistered_while_its_request_computes_is_not_found(tmp_path: Path) -> None:
    """The output slice is checked before the compute and looked up again to write."""
    x = np.ones((1, 2, C), np.float32)
    (tmp_path / "out").write_bytes(bytes(x.nbytes))
    regions = Regions(True, 4, tmp_path)
    regions.register("out", "/out", 0, x.nbytes)
    request = _shm_request(x.shape, "in", out=("out", 0))
    neutral = request_from_proto(request)
    target = output_slice(neutral, x.shape, regions)
    assert target == RegionSlice("out", x.nbytes, 0)
    regions.unregister("out")  # meanwhile, the client unregisters it
    with pytest.raises(RegionNotFound, match="'out'"):
        answered(neutral, SPEC, x, "torch", target, regions)
    assert (tmp_path / "out").read_bytes() == bytes(x.nbytes)


def test_http_registration_refuses_what_is_not_a_registration(small_model_dir: Path, objects) -> None:
    import json

    key = _key(_object(objects, 64))
    settings = make_settings(small_model_dir, backend="torch", shared_memory="system", http_port=0)

    def post(path: str, body: bytes) -> tuple[int, dict]:
        return http_raw(s.http_port, path, body)

    bad = {
        "not-json": b"\xff{",
        "not-an-object": b"[1, 2]",
        "negative-offset": json.dumps({"key": key, "offset": -1, "byte_size": 8}).encode(),
        "bool-size": json.dumps({"key": key, "byte_size": True}).encode(),
        "text-size": json.dumps({"key": key, "byte_size": "8"}).encode(),
        "huge-size": json.dumps({"key": key, "byte_size": 2**70}).encode(),
        "no-key": json.dumps({"byte_size": 8}).encode(),
    }
    with ServerThread(settings) as s:
        for name, body in bad.items():
            code, answer = post("/v2/systemsharedmemory/region/r/register", body)
            assert code == 400 and answer["error"], (name, code, answer)
        assert (
            post("/v2/systemsharedmemory/region/r/register", json.dumps({"key": key, "byte_size": 64}).encode())[0]
            == 200
        )
        code, answer = post(
            "/v2/systemsharedmemory/region/r/register", json.dumps({"key": key, "byte_size": 64}).encode()
        )
        assert code == 409 and "already registered" in answer["error"]


_SHORT_WRITE = """
import resource, signal, sys
from pathlib import Path
import numpy as np
from service.errors import Overloaded
from service.protocol.shm import RegionSlice, Regions

directory = Path(sys.argv[1])
(directory / "out").write_bytes(bytes(256))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))  # the file takes bytes up to 200 only
regions = Regions(True, 2, directory)
regions.register("out", "/out", 0, 256)
try:
    regions.write(RegionSlice("out", 128, 128), np.ones(32, np.float32))  # bytes 128..256: 72 fit
except Overloaded as exc:
    print("refused:", exc)
else:
    print("answered OK")
"""


def test_an_output_the_object_takes_only_in_part_is_refused_naming_the_region(tmp_path: Path) -> None:
    """A short pwrite (here a file size limit; on a host, full shared memory) is no OK answer
    with part of its output: RESOURCE_EXHAUSTED, naming the region and what it took."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SHORT_WRITE, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert "refused: region 'out': its object '/out' took 72 of the output's 128 bytes" in done.stdout, (
        done.stdout + done.stderr
    )


class _Allocations:
    """CUDA's part of a registration, as a stand-in (no device here; tests/e2e/test_cuda_shm.py
    runs the real one on a GPU): every handle names an allocation of `size` bytes."""

    device_count = 1

    def __init__(self, size: int) -> None:
        self.size, self.opened, self.closed = size, 0, 0

    def open(self, raw_handle: bytes, device_id: int) -> tuple[int, int]:
        self.opened += 1
        return 0x7F0000000000 + self.opened * 2**21, self.size

    def close(self, region: object) -> None:
        self.closed += 1


def test_a_cuda_region_larger_than_its_allocation_is_refused_and_its_handle_closed() -> None:
    from service.protocol.cuda_shm import CudaRegions

    allocations = _Allocations(4096)
    regions = CudaRegions(True, "off", allocations)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="exceeds the 4096 bytes of the allocation"):
        regions.register("wide", b"\1" * 64, 0, 4097)
    assert "wide" not in regions and allocations.closed == 1, "refused, and its handle closed"
    regions.register("fits", b"\1" * 64, 0, 4096)
    assert [r.byte_size for r in regions.status("")] == [4096]
    with pytest.raises(InvalidInput, match="exceeds its registered byte_size"):
        regions.check("fits", 1, 4096)
    regions.close()
    assert allocations.closed == 2 and len(regions) == 0


@pytest.fixture(scope="module")
def cuda_stub(small_model_dir: Path) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    settings = make_settings(small_model_dir, backend="torch", shared_memory="system,cuda")
    with ServerThread(settings) as s, grpc.insecure_channel(s.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


# Any registration a client can send: refused with a status that says why, never INTERNAL, and the
# server goes on serving. (Without a device every well-formed one is UNIMPLEMENTED.)
@settings(max_examples=150, deadline=None)
@given(
    name=st.text(max_size=200),
    handle=st.binary(max_size=130),
    device=st.integers(-(2**63), 2**63 - 1),
    size=st.integers(0, 2**64 - 1),
)
def test_any_cuda_registration_is_answered_with_a_reason(cuda_stub, name, handle, device, size) -> None:
    request = pb.CudaSharedMemoryRegisterRequest(name=name, raw_handle=handle, device_id=device, byte_size=size)
    code, message = _code(cuda_stub.CudaSharedMemoryRegister, request)
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED), (code, message)
    assert message and len(message) < 1000
    assert not cuda_stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
