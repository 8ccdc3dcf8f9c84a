"""A clean stop logs nothing above INFO: SIGTERM to `mha serve --workers 2` under load, with open
hand-over connections, live sequences, an open stream and a registered shared memory region,
leaves no WARNING or ERROR line (on-call engineers alert on them), and exits 0."""

from __future__ import annotations

import json
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np

from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from tests.support import ServerProcess

LOUD = ("WARNING", "ERROR", "CRITICAL")


def _load(url: str, stop: threading.Event, seen: list[str]) -> None:
    """Stateless requests and steps of sequences, one channel, until `stop` or until the server
    goes away; each sequence started on a connection of its own (so on either worker), and its
    later steps handed to its owner when that is the other worker."""
    x = np.ones((1, 4, 32), np.float32)
    offsets = {f"stop-{n}": 0 for n in range(8)}
    with MHAClient(url) as client:
        while not stop.is_set():
            try:
                client.infer(x, timeout=10)
                for sequence_id, offset in offsets.items():
                    offsets[sequence_id] = _step(client, url, sequence_id, x, offset)
                seen.append("ok")
            except InferenceError as exc:  # refused while draining, or the server has gone: expected
                seen.append(exc.code.name)
                time.sleep(0.05)


def _step(client: MHAClient, url: str, sequence_id: str, x: np.ndarray, offset: int) -> int:
    if offset > 0:
        return client.step(sequence_id, x, offset=offset, timeout=10).length
    with MHAClient(url, own_connection=True) as own:
        return own.step(sequence_id, x, offset=0, start=True, timeout=10).length


def _stream(url: str, opened: threading.Event) -> None:
    """A stream that stays open, one request at a time, until the server ends it."""

    def requests():  # type: ignore[no-untyped-def]
        for i in range(10_000):
            request = pb.ModelInferRequest(model_name="mha", id=str(i))
            request.inputs.add(name="x", datatype="FP32", shape=[1, 2, 32])
            request.raw_input_contents.append(np.ones((1, 2, 32), np.float32).tobytes())
            yield request
            opened.set()
            time.sleep(0.02)

    with grpc.insecure_channel(url) as channel:
        try:
            for _ in pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=60):
                pass
        except grpc.RpcError:
            pass  # ended by the drain


def test_sigterm_under_load_logs_nothing_above_info(small_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2", "--shared-memory", "system"]
    server = ServerProcess(args)
    server.start(tmp_path / "server.log")
    memory = shared_memory.SharedMemory(create=True, size=4096)
    stop, opened, seen = threading.Event(), threading.Event(), []
    threads = [threading.Thread(target=_load, args=(server.url, stop, seen)) for _ in range(3)]
    threads.append(threading.Thread(target=_stream, args=(server.url, opened)))
    try:
        with grpc.insecure_channel(server.url) as channel:
            register = pb.SystemSharedMemoryRegisterRequest(name="r", key="/" + memory.name, byte_size=memory.size)
            pb_grpc.GRPCInferenceServiceStub(channel).SystemSharedMemoryRegister(register, timeout=30)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while (seen.count("ok") < 6 or not opened.is_set()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert seen.count("ok") >= 6 and opened.is_set(), seen[-5:]  # under load, every part open
        code = server.terminate(timeout=60)
    finally:
        stop.set()
        server.kill()
        memory.close()
        memory.unlink()
    for thread in threads:
        thread.join(30)
    log = server.log()
    assert code == 0, log[-3000:]
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    loud = [f"{r['level']}: {r['msg'][:300]}" for r in records if r["level"] in LOUD]
    assert loud == [], loud
    raw = [line for line in log.splitlines() if line.strip() and not line.startswith("{")]
    assert raw == [], raw[:10]  # nothing printed outside the log (a traceback, gRPC core's own lines)
    assert any("draining" in r["msg"] for r in records)
