"""`mha serve --workers 2`: both workers serve one port, metrics add up, a dead worker is
replaced, SIGTERM drains them all."""

from __future__ import annotations

import errno
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.app.supervisor import SUPERVISOR_BYTES
from service.client.client import InferenceError, MHAClient
from service.client.parity import verify_server
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request, parameter_values
from service.protocol.peers import FORWARDED_METHOD
from tests.support import ServerProcess, free_ports, own_memory_bytes, until

STARTED = re.compile(r"worker (\d+) started \(pid (\d+), metrics 127\.0\.0\.1:(\d+)\)")


def _samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _ok(samples: dict, method: str = "ModelInfer") -> float:
    return samples.get(("mha_requests_total", (("code", "OK"), ("method", method))), 0.0)


_until = partial(until, timeout_s=120, every_s=0.2)


def _compute_libraries(pid: int) -> set[str]:
    """The ONNX Runtime and PyTorch shared libraries mapped into the process `pid`."""
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return {p for p in paths if "/torch/" in p or "/onnxruntime/" in p}


def _said(log: str, start: str) -> list[tuple[int | None, str]]:
    """(worker, message) of every JSON log line whose message begins with `start`."""
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [(line.get("worker"), line["msg"]) for line in lines if line["msg"].startswith(start)]


def test_two_workers_share_the_port_add_up_restart_and_drain(small_model_dir: Path, tmp_path: Path) -> None:
    """The backends are timed once, by the first worker: the other, and a worker restarted,
    make its choices (both backends raced, as `--backend auto` does)."""
    args = ["--model-dir", str(small_model_dir), "--workers", "2", "--max-inflight-mb", "64"]
    server = ServerProcess(args)
    server.start(tmp_path / "server.log")
    try:
        started = {int(i): (int(pid), int(port)) for i, pid, port in STARTED.findall(server.log())}
        assert sorted(started) == [0, 1]

        def both_ready() -> bool:  # the port answers once one worker has bound it; the other may still load
            samples = _samples(server.metrics_port)
            return all(samples.get(("mha_ready", (("worker", str(i)),))) == 1.0 for i in range(2))

        _until(both_ready)
        chosen = _said(server.log(), "backend selection: ")
        assert [w for w, _ in chosen] == [0, 1] and chosen[0][1] == chosen[1][1], chosen  # probes' times too
        assert [w for w, _ in _said(server.log(), "backends timed by another worker")] == [1]
        assert server.proc is not None
        heavy = _compute_libraries(server.proc.pid)
        assert not heavy, f"the supervisor loaded what only workers use: {heavy}"  # 340 MB of it before
        own = own_memory_bytes(server.proc.pid)  # what the memory bound of --workers counts for it
        assert own <= SUPERVISOR_BYTES, f"the supervisor holds {own / 2**20:.0f} MiB of its own"
        assert _compute_libraries(started[0][0]), "the check must see a worker's ONNX Runtime and PyTorch"
        x = np.ones((1, 3, 32), np.float32)
        for _ in range(40):  # a connection each (not gRPC's shared one): the kernel spreads them
            with MHAClient(server.url, own_connection=True) as client:
                client.infer(x)
        _until(lambda: _ok(_samples(server.metrics_port)) == 40)  # each worker writes its series within 0.25 s
        per_worker = [_ok(_samples(port)) for _, port in started.values()]
        total = _samples(server.metrics_port)
        assert all(n > 0 for n in per_worker) and sum(per_worker) == 40 == _ok(total)
        assert total[("mha_request_duration_seconds_count", (("method", "ModelInfer"),))] == 40  # histograms add up
        assert {total[("mha_ready", (("worker", str(i)),))] for i in range(2)} == {1.0}  # gauges by worker
        budgets = [total[("mha_inflight_budget_bytes", (("worker", str(i)),))] for i in range(2)]
        assert budgets == [32 * 2**20] * 2  # the server's 64 MiB, not each worker's (before: 128 MiB in all)
        memory = {dict(k[1])["worker"] for k in total if k[0] == "process_resident_memory_bytes"}
        assert memory == {"0", "1"}  # each worker's process, as the dashboard's memory panel shows it
        ready = [line for line in server.log().splitlines() if " ready: serving" in line]
        assert len(ready) == 2 and all("metrics: the supervisor's port" in line for line in ready), ready
        assert not any(f":{port}" in line for line in ready for _, port in started.values())  # no private port

        os.kill(started[0][0], signal.SIGKILL)
        seen: list[float] = []  # the merged counter at every scrape while worker 0 is replaced

        def merged(key: tuple) -> float | None:
            samples = _samples(server.metrics_port)
            seen.append(_ok(samples))
            return samples.get(key)

        _until(lambda: merged(("mha_worker_restarts_total", (("worker", "0"),))) == 1.0)
        _until(lambda: merged(("mha_ready", (("worker", "0"),))) == 1.0)
        chosen = _said(server.log(), "backend selection: ")
        assert [w for w, _ in chosen] == [0, 1, 0] and len({m for _, m in chosen}) == 1, chosen
        assert [w for w, _ in _said(server.log(), "backends timed by another worker")] == [1, 0]
        assert "worker 0 (pid" in server.log() and "died with exit code -9; restarting it" in server.log()
        assert seen and min(seen) == 40, f"the merged counter went down while a worker was replaced: {seen[:8]}"
        for _ in range(10):
            with MHAClient(server.url) as client:
                assert client.infer(x).shape == x.shape
        _until(lambda: _ok(_samples(server.metrics_port)) == 50)  # the dead worker's 40-share still counted

        pids = [int(pid) for _, pid, _ in STARTED.findall(server.log())]
        assert server.terminate(timeout=60) == 0
        for pid in pids:  # every worker is gone (or a zombie waiting for its reaper)
            status = Path(f"/proc/{pid}/status")
            assert not status.exists() or "zombie" in status.read_text().lower()
    finally:
        server.kill()


def _reading_a_pipe(pid: int) -> bool:
    """Is a thread of process `pid` asleep in a read of a pipe (its kernel wait channel)?"""
    tasks = Path(f"/proc/{pid}/task")
    return any("pipe" in (task / "wchan").read_text() for task in tasks.iterdir())


def test_a_worker_told_to_wait_loads_only_once_its_pipe_closes(small_model_dir: Path) -> None:
    """The supervisor starts the workers together and lets all but the first load only once the
    first has (so that a model that cannot load is said once): a worker given --worker-wait-fd
    imports its libraries, says that it waits, and neither loads nor binds until every writer of
    the pipe has closed it."""
    read, write = os.pipe()
    port = free_ports(1)[0]
    serve = ["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "1", "--reuse-port"]
    serve += ["--grpc-port", str(port), "--http-port", "off", "--metrics-port", "off", "--worker-wait-fd", str(read)]
    env = {**os.environ, "MHA_LOG_LEVEL": "DEBUG", "MHA_LOG_FORMAT": "text"}
    command = [sys.executable, "-m", "service.cli", "serve", *serve]
    proc = subprocess.Popen(command, pass_fds=(read,), stderr=subprocess.PIPE, text=True, env=env)
    os.close(read)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr or ()], daemon=True).start()

    def through(text: str) -> list[str]:
        seen = [lines.get(timeout=120)]
        while text not in seen[-1]:
            seen.append(lines.get(timeout=120))
        return seen

    try:
        waiting = through("waiting for the first worker to load")
        _until(lambda: _reading_a_pipe(proc.pid))  # blocked there, with nothing to read before the close
        assert not any("loaded from" in line for line in waiting), waiting
        with socket.socket() as probe:  # not bound: a worker binds once it has loaded
            assert probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
        os.close(write)
        loading = through(" ready: serving")
        go = next(i for i, line in enumerate(loading) if "the first worker has loaded: loading" in line)
        assert go < next(i for i, line in enumerate(loading) if "loaded from" in line), loading
        with MHAClient(f"127.0.0.1:{port}") as client:
            assert client.infer(np.ones((1, 3, 32), np.float32)).shape == (1, 3, 32)
    finally:
        proc.kill()
        proc.wait()


READY_PORTS = re.compile(r"worker (\d) ready: serving mha on [^,]+, gRPC :(\d+), HTTP :(\d+), health :(\d+) \(shared")


def test_workers_share_the_health_port_and_the_ports_picked_for_them(small_model_dir: Path, tmp_path: Path) -> None:
    """--health-port (mTLS deployments' probes) and ports given as 0 are shared by every worker,
    as the gRPC port is: no worker fails to bind, none serves a port of its own."""
    args = ["--model-dir", str(small_model_dir), "--backend", "torch", "--http-port", "0", "--health-port", "0"]
    server = ServerProcess(args, workers="2")  # the last --http-port given wins: 0, picked for the workers
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: len(READY_PORTS.findall(server.log())) == 2)
        ready = {int(i): (int(g), int(h), int(health)) for i, g, h, health in READY_PORTS.findall(server.log())}
        assert sorted(ready) == [0, 1] and ready[0] == ready[1], ready
        grpc_port, http_port, health_port = ready[0]
        assert grpc_port == server.port and 0 not in (http_port, health_port)
        for _ in range(10):  # a connection each: the kernel spreads them over both workers' sockets
            with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=5) as response:
                assert response.status == 200
        assert "died" not in server.log(), server.log()[-2000:]
    finally:
        server.kill()


def _ready_workers(server: ServerProcess) -> int:
    samples = _samples(server.metrics_port)
    return sum(samples.get(("mha_ready", (("worker", str(i)),)), 0.0) == 1.0 for i in range(2))


def test_one_channel_reaches_every_worker_as_its_connection_ages(small_model_dir: Path, tmp_path: Path) -> None:
    """--grpc-max-connection-age-s: the server asks an aged connection to go, its client reconnects,
    and the kernel gives the new connection to either worker, so the requests of one channel reach
    both over time (without it they stay on one for as long as the channel lives). A stream open
    across the ages goes on (no grace limit by default), and no call fails."""
    args = ["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"]
    server = ServerProcess([*args, "--grpc-max-connection-age-s", "0.3"])
    server.start(tmp_path / "server.log")
    try:
        started = {int(i): int(port) for i, _, port in STARTED.findall(server.log())}
        _until(lambda: _ready_workers(server) == 2)
        x = np.ones((1, 3, 32), np.float32)
        requests: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
        with MHAClient(server.url) as client:  # one channel, one connection at a time
            stream = client.stub.ModelStreamInfer(iter(requests.get, None), timeout=120)
            requests.put(encode_infer_request(x, request_id="before"))
            assert next(stream).infer_response.id == "before"
            deadline = time.monotonic() + 60
            while min(_ok(_samples(port)) for port in started.values()) == 0:
                assert time.monotonic() < deadline, "one channel's requests stayed on one worker"
                for _ in range(10):
                    client.infer(x, timeout=30)  # raises if any call fails
            requests.put(encode_infer_request(x, request_id="after"))
            assert next(stream).infer_response.id == "after"  # on the connection that was asked to go
            requests.put(None)
    finally:
        server.stop()


def _grpc_step(url: str, sequence_id: str, x: np.ndarray, offset: int, entry: str = "mha") -> tuple[np.ndarray, dict]:
    """A step on a channel of its own: a new connection, which the kernel gives to either worker."""
    with MHAClient(url) as client:
        request = encode_infer_request(x, entry)
        request.parameters["sequence_id"].string_param = sequence_id
        request.parameters["sequence_start"].bool_param = offset == 0
        request.parameters["sequence_offset"].int64_param = offset
        response = client.stub.ModelInfer(request, metadata=(("mha-sequence-id", sequence_id),), timeout=30)
    assert response.model_name == entry
    return decode_infer_response(response), parameter_values(response.parameters)


def _http_step(
    port: int, sequence_id: str, x: np.ndarray, offset: int, timeout_us: int = 0, entry: str = "mha"
) -> tuple[np.ndarray, dict]:
    """A step as curl or urllib sends it: a new connection each time."""
    parameters = {"sequence_id": sequence_id, "sequence_start": offset == 0, "sequence_offset": offset}
    parameters |= {"timeout": timeout_us} if timeout_us else {}
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    body = json.dumps({"inputs": [tensor], "parameters": parameters}).encode()
    headers = {"Content-Type": "application/json", "mha-sequence-id": sequence_id}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{entry}/infer", body, headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        doc = json.loads(response.read())
    assert doc["model_name"] == entry
    return np.array(doc["outputs"][0]["data"], np.float32).reshape(x.shape), doc["parameters"]


def test_every_connection_reaches_a_sequences_state_with_two_workers(small_model_dir: Path, tmp_path: Path) -> None:
    """The issue's scenario: a prefix of 8 tokens and 24 one-token steps, each step on a new
    connection (gRPC and HTTP), with --workers 2: every step exact, none refused, and the steps
    that reached the other worker were handed to the owner (the worker its first step reached),
    and counted once in the replica's statistics; on both model entries."""
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: _ready_workers(server) == 2)
        config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
        rng = np.random.default_rng(5)
        for protocol in ("grpc", "http"):
            for n in range(3):
                sequence_id, entry = f"{protocol}-{n}", ("mha_sequence", "mha")[n % 2]
                whole, owner = np.zeros((1, 0, 32), np.float32), None
                for t in [8] + [1] * 24:
                    x = rng.standard_normal((1, t, 32), dtype=np.float32)
                    offset = whole.shape[1]
                    whole = np.concatenate([whole, x], axis=1)  # (1, P + t, 32)
                    if protocol == "grpc":
                        y, said = _grpc_step(server.url, sequence_id, x, offset, entry)
                    else:
                        y, said = _http_step(server.http_port, sequence_id, x, offset, entry=entry)
                    reference = attention_view(torch.from_numpy(whole), weights, config)[:, -t:]
                    assert relative_error(torch.from_numpy(y.copy()), reference) < 1e-5, (sequence_id, offset)
                    assert said["sequence_length"] == whole.shape[1]
                    owner = said["worker"] if owner is None else owner
                    assert said["worker"] == owner
        handed = _ok(_samples(server.metrics_port), FORWARDED_METHOD)
        assert 0 < handed < 6 * 25, handed
        with grpc.insecure_channel(server.url) as channel:  # each step once, where its client sent it
            stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(), timeout=30)
        assert sum(s.inference_stats.success.count for s in stats.model_stats) == 6 * 25
        for _ in range(6):  # a deadline that passes, wherever the step lands: 504, never a server fault
            x = rng.standard_normal((1, 1, 32), dtype=np.float32)
            with pytest.raises(urllib.error.HTTPError) as info:
                _http_step(server.http_port, "http-0", x, 32, timeout_us=1)
            assert info.value.code == 504, info.value.read()
        with MHAClient(server.url) as client:
            client.step("grpc-0", x, 32, end=True)
        for n in range(40):  # after its end, wherever a step lands, it is told what became of the sequence
            with MHAClient(server.url) as client, pytest.raises(InferenceError) as refused:
                client.step("grpc-0", x, 33)
            assert refused.value.code == grpc.StatusCode.NOT_FOUND and "ended (sequence_end)" in str(refused.value)
            if n >= 7 and _handed_over_lines(server.log()):
                break  # one at least reached the other worker (each does by half a chance)
        # a handing worker logs its call after its answer, which the client may read before: wait for its line
        _until(lambda: all(callers for _, callers in _handed_over_lines(server.log())), timeout_s=30)
        handed_lines = _handed_over_lines(server.log())
        assert handed_lines and all(len(callers) == 1 for _, callers in handed_lines), handed_lines
    finally:
        server.kill()


def _handed_over_lines(log_text: str) -> list[tuple[dict, list[dict]]]:
    """Each log line of a handed-over call, with the lines of the call that handed it over: the
    same request id, logged by the other worker. Every call's line says which worker wrote it."""
    calls = [json.loads(line) for line in log_text.splitlines() if line.startswith("{") and '"method"' in line]
    assert calls and all(call.get("worker") in (0, 1) for call in calls), calls[:3]
    return [
        (call, [c for c in calls if c["request_id"] == call["request_id"] and c["worker"] != call["worker"]])
        for call in calls
        if call["method"] == FORWARDED_METHOD
    ]


def test_mha_verify_checks_the_hand_over_of_steps_between_workers(small_model_dir: Path, tmp_path: Path) -> None:
    """`mha verify --url` against two workers: the steps sent each on a new connection reach the
    worker that does not hold their sequence too, are handed over, and answer exactly; the
    steps on one connection stay where they began."""
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: _ready_workers(server) == 2)
        before = _ok(_samples(server.metrics_port), FORWARDED_METHOD)
        report = verify_server(server.url, small_model_dir, shapes=[(1, 64), (2, 63), (1, 60), (1, 62)])
        assert report.ok and report.routes["gRPC steps, reconnecting"].ok, report.table()
        # each T: its first half, then 8 steps (of 1, 2, 3, ... tokens), each a new connection to
        # either worker: 32 that may land on the worker without the sequence (none do: 2 ** -32).
        # A worker writes its counts for the merge every 0.25 s: read until they are there.
        _until(lambda: _ok(_samples(server.metrics_port), FORWARDED_METHOD) > before, timeout_s=10)
        handed = _ok(_samples(server.metrics_port), FORWARDED_METHOD) - before
        assert 0 < handed <= 4 * 8, handed
    finally:
        server.kill()


def _exemplars(port: int) -> dict[str, str]:
    """The trace id of each latency bucket's exemplar on /metrics, read as Prometheus reads it
    (OpenMetrics, asked for): {le: trace id}."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {
        s.labels["le"]: s.exemplar.labels["trace_id"]
        for family in openmetrics_families(text)
        for s in family.samples
        if s.name == "mha_request_duration_seconds_bucket" and s.labels.get("method") == "ModelInfer" and s.exemplar
    }


def test_a_sequence_lives_where_its_first_step_landed(small_model_dir: Path, tmp_path: Path) -> None:
    """A client of one channel pays no hand-over: every sequence it starts lives on the worker
    its channel reached. Ended, a sequence is nobody's: started again through the other worker,
    it lives there. A first step refused leaves no owner behind."""
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    x = np.ones((1, 2, 32), np.float32)
    try:
        _until(lambda: _ready_workers(server) == 2)
        with MHAClient(server.url) as client:
            homes = {client.step(f"one-{n}", x, offset=0, start=True).worker for n in range(8)}
            homes |= {client.step(f"one-{n}", x, offset=2).worker for n in range(8)}
            assert len(homes) == 1, homes  # by the sequence id alone, half would live on the other worker
            client.step("one-0", x, offset=4, end=True)
            with pytest.raises(InferenceError) as refused:
                client.step("refused", np.ones((1, 2, 16), np.float32), offset=0, start=True)
            assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        (here,) = homes
        for n in range(64):  # a connection of its own that reached the other worker
            with MHAClient(server.url, own_connection=True) as own:
                if own.step(f"probe-{n}", x, offset=0, start=True).worker == here:
                    continue
                assert own.step("one-0", x, offset=0, start=True).worker == 1 - here
                assert own.step("refused", x, offset=0, start=True).worker == 1 - here
                assert own.step("one-1", x, offset=4).worker == here  # handed over to its owner
                break
        else:
            pytest.fail("64 new connections all reached one worker")
    finally:
        server.kill()


def test_latency_exemplars_reach_the_merged_metrics_of_several_workers(small_model_dir: Path, tmp_path: Path) -> None:
    """Tracing on, two workers: each traced call's trace id rides on its latency bucket of the
    supervisor's /metrics, as with one process (prometheus-client's multiprocess merge keeps none
    of them itself), and each one names a trace the exporter delivered. A step handed to the
    worker that holds its sequence is traced there in its caller's trace."""
    from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

    with OtlpReceiver() as receiver:
        args = ["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"]
        server = ServerProcess([*args, "--otlp-endpoint", receiver.endpoint])
        server.start(tmp_path / "server.log")
        try:
            _until(lambda: _ready_workers(server) == 2)
            for _ in range(20):  # a connection each (not gRPC's shared one): both workers serve some
                with MHAClient(server.url, own_connection=True) as client:
                    client.infer(np.ones((1, 3, 32), np.float32))
            found: dict[str, str] = {}

            def seen() -> bool:
                found.update(_exemplars(server.metrics_port))
                return bool(found)

            _until(seen, timeout_s=30)
            _until(
                lambda: set(found.values()) <= {span.trace_id for span in receiver.named("ModelInfer")}, timeout_s=30
            )
            x = np.ones((1, 4, 32), np.float32)
            with MHAClient(server.url) as client:
                client.step("traced", x, offset=0, start=True)
            for n in range(16):  # a connection each: some reach the worker without the sequence
                with MHAClient(server.url) as client:
                    client.step("traced", x[:, :1], offset=4 + n)
            _until(lambda: bool(receiver.named(FORWARDED_METHOD)), timeout_s=30)
            handed = receiver.named(FORWARDED_METHOD)

            def callers() -> dict[tuple[str, str], ReceivedSpan]:
                return {(span.trace_id, span.span_id): span for span in receiver.named("ModelInfer")}

            _until(lambda: all((s.trace_id, s.parent_span_id) in callers() for s in handed), timeout_s=30)
            for span in handed:  # each in its caller's trace, a child of the caller's call, under its id
                caller = callers()[span.trace_id, span.parent_span_id]
                assert caller.attributes["mha.request_id"] == span.attributes["mha.request_id"], (caller, span)
                assert caller.resource["mha.worker"] != span.resource["mha.worker"], (caller, span)
            below = {(span.trace_id, span.span_id) for span in handed}  # and the step computed there is its child
            _until(
                lambda: any((s.trace_id, s.parent_span_id) in below for s in receiver.named("decode step")),
                timeout_s=30,
            )
        finally:
            server.kill()
    assert all(len(trace) == 32 for trace in found.values()), found


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text().lower()
    except FileNotFoundError:
        return False


def test_no_worker_outlives_its_supervisor(small_model_dir: Path, tmp_path: Path) -> None:
    """The supervisor killed with SIGKILL (no handler runs): both workers follow it within
    seconds, and a new server on the same ports serves alone."""
    args = ["--model-dir", str(small_model_dir), "--backend", "torch"]
    server = ServerProcess([*args, "--workers", "2"])
    server.start(tmp_path / "server.log")
    pids: list[int] = []
    try:
        _until(lambda: len(STARTED.findall(server.log())) == 2)
        pids += [int(pid) for _, pid, _ in STARTED.findall(server.log())]
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait(10)
        _until(lambda: not any(_alive(pid) for pid in pids), timeout_s=30)
    finally:
        server.kill()
        for pid in filter(_alive, pids):  # red: no worker left holding ports and memory for later tests
            os.kill(pid, signal.SIGKILL)
    alone = ServerProcess(args, grpc_port=server.port, http_port=server.http_port)  # nobody holds them now
    alone.start(tmp_path / "alone.log")
    try:
        with MHAClient(alone.url) as client:
            assert client.infer(np.ones((1, 2, 32), np.float32)).shape == (1, 2, 32)
    finally:
        alone.kill()


@pytest.mark.parametrize("tmpdir_length", [0, 100], ids=["tmpdir", "tmpdir-too-long-for-a-socket"])
def test_a_server_stopped_by_its_launcher_leaves_no_worker_and_no_folder(
    small_model_dir: Path, tmp_path: Path, tmpdir_length: int
) -> None:
    """`ServerProcess.stop`, as `mha tune` stops each server it measured: when it returns, no
    worker is left running and the supervisor's sockets and metrics folders are gone. A TMPDIR
    too long for a socket's path in it: the sockets go under /tmp, and the workers serve."""
    if tmpdir_length:
        scratch = tmp_path / ("s" * max(1, tmpdir_length - len(str(tmp_path)) - 1))
        scratch.mkdir()
    else:  # short enough wherever pytest's own folders are
        scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir="/tmp"))
    server = ServerProcess(["--model-dir", str(small_model_dir), "--workers", "2"], env={"TMPDIR": str(scratch)})
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: len(STARTED.findall(server.log())) == 2)
        pids = [int(pid) for _, pid, _ in STARTED.findall(server.log())]
        moved = re.findall(r"hand-over sockets are in (\S+): TMPDIR is too long", server.log())
        sockets = Path(moved[0]) if tmpdir_length else next(scratch.glob("mha-workers-*"))
        assert sockets.is_dir() and next(scratch.glob("mha-metrics-*")).is_dir()
        assert {"worker-0.sock", "worker-1.sock"} <= {p.name for p in sockets.iterdir()}
        server.stop()
        assert [pid for pid in pids if _alive(pid)] == []
        assert [p.name for p in scratch.iterdir() if p.name.startswith("mha-")] == [] and not sockets.exists()
    finally:
        server.kill()
        shutil.rmtree(scratch, ignore_errors=True)


def _stub_call(url: str, method: str, request: object, metadata: tuple = ()) -> object:
    """One call on a channel of its own: a new connection, which either worker may accept."""
    with grpc.insecure_channel(url) as channel:
        return getattr(pb_grpc.GRPCInferenceServiceStub(channel), method)(request, metadata=metadata, timeout=30)


def _placed(request: pb.ModelInferRequest, region: str, shape: tuple[int, ...]) -> pb.ModelInferRequest:
    """x and y in `region`: x at offset 0, y right after it."""
    nbytes = int(np.prod(shape)) * 4
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(shape))
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
    out = request.outputs.add(name="y")
    out.parameters["shared_memory_region"].string_param = region
    out.parameters["shared_memory_byte_size"].int64_param = nbytes
    out.parameters["shared_memory_offset"].int64_param = nbytes
    return request


def test_shared_memory_regions_are_one_set_for_every_worker(small_model_dir: Path, tmp_path: Path) -> None:
    """Registered through one connection, a region is seen and usable through every other one,
    for stateless requests and for the steps of sequences owned by either worker; unregistered
    through one, it is gone for all."""
    args = ["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2", "--shared-memory", "system"]
    server = ServerProcess(args)
    server.start(tmp_path / "server.log")
    memory = shared_memory.SharedMemory(create=True, size=2 * 8 * 32 * 4)
    try:
        _until(lambda: _ready_workers(server) == 2)
        config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
        key = "/" + memory.name.lstrip("/")
        register = pb.SystemSharedMemoryRegisterRequest(name="shared", key=key, byte_size=memory.size)
        _stub_call(server.url, "SystemSharedMemoryRegister", register)
        for _ in range(8):
            status = _stub_call(server.url, "SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest())
            assert list(status.regions) == ["shared"]  # type: ignore[attr-defined]
        rng = np.random.default_rng(3)
        view = np.ndarray((2, 1, 8, 32), np.float32, buffer=memory.buf)  # [x, y]
        for _ in range(8):  # stateless, each on a new connection
            view[0] = rng.standard_normal((1, 8, 32), dtype=np.float32)
            _stub_call(server.url, "ModelInfer", _placed(pb.ModelInferRequest(model_name="mha"), "shared", (1, 8, 32)))
            reference = attention_view(torch.from_numpy(view[0].copy()), weights, config)
            assert relative_error(torch.from_numpy(view[1].copy()), reference) < 1e-5
        firsts: dict[int, tuple[str, np.ndarray]] = {}  # owner -> a sequence it owns, and its first token
        for n in range(64):  # first steps carried in the request, each on a connection of its own
            x = rng.standard_normal((1, 1, 32), dtype=np.float32)
            firsts.setdefault(_grpc_step(server.url, f"shm-{n}", x, 0)[1]["worker"], (f"shm-{n}", x))
            if len(firsts) == 2:
                break
        assert sorted(firsts) == [0, 1]
        for owner, (sequence_id, whole) in firsts.items():  # then its steps through shared memory
            for i in range(1, 6):
                x = rng.standard_normal((1, 1, 32), dtype=np.float32)
                whole = np.concatenate([whole, x], axis=1)  # (1, P + 1, 32)
                view[0, :, :1] = x
                request = _placed(pb.ModelInferRequest(model_name="mha"), "shared", (1, 1, 32))
                request.parameters["sequence_id"].string_param = sequence_id
                request.parameters["sequence_offset"].int64_param = i
                answer = _stub_call(server.url, "ModelInfer", request)
                assert answer.parameters["sequence_length"].int64_param == i + 1  # type: ignore[attr-defined]
                assert answer.parameters["worker"].int64_param == owner  # type: ignore[attr-defined]
                y = np.frombuffer(memory.buf, np.float32, 32, offset=4 * 32).reshape(1, 1, 32).copy()
                reference = attention_view(torch.from_numpy(whole), weights, config)[:, -1:]
                assert relative_error(torch.from_numpy(y), reference) < 1e-5
        _stub_call(server.url, "SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="shared"))
        for _ in range(8):
            status = _stub_call(server.url, "SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest())
            assert list(status.regions) == []  # type: ignore[attr-defined]
    finally:
        memory.close()
        memory.unlink()
        server.kill()


def test_a_hung_worker_is_found_and_replaced(small_model_dir: Path, tmp_path: Path) -> None:
    """A worker alive but answering nothing (stopped with SIGSTOP, as a hung loop would be): the
    supervisor's watchdog kills it once it has been silent for --worker-watchdog-s, and it is
    replaced. Silent for less (a loop busy for seconds with large JSON bodies), it is left be."""
    args = ["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2", "--worker-watchdog-s", "8"]
    server = ServerProcess(args)
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: server.log().count("the watchdog watches it from now") == 2)
        pid = int(STARTED.findall(server.log())[0][1])
        os.kill(pid, signal.SIGSTOP)  # a few seconds: one ask missed at most
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)
        time.sleep(5)  # the asks after it answer
        assert "silent for" not in server.log() and _alive(pid)
        os.kill(pid, signal.SIGSTOP)
        _until(lambda: "silent for 8 s (--worker-watchdog-s)" in server.log(), timeout_s=60)
        restarted = ("mha_worker_restarts_total", (("worker", "0"),))
        _until(lambda: _samples(server.metrics_port).get(restarted) == 1.0)
        _until(lambda: _ready_workers(server) == 2)
        assert not _alive(pid)
    finally:
        server.kill()


def test_a_dead_workers_metrics_port_is_held_for_the_worker_that_replaces_it(
    small_model_dir: Path, tmp_path: Path
) -> None:
    """Between a worker's death and its replacement's start, no other process can take the port
    the watchdog asks it on (the supervisor keeps it bound), and the replacement answers there.
    The supervisor is stopped (SIGSTOP) meanwhile, so that the gap lasts as long as the test."""
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: server.log().count("the watchdog watches it from now") == 2)
        index, pid, port = STARTED.findall(server.log())[1]
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            os.kill(int(pid), signal.SIGKILL)
            _until(lambda: not _alive(int(pid)), timeout_s=10)
            with socket.socket() as thief, pytest.raises(OSError) as taken:
                thief.bind(("127.0.0.1", int(port)))
            assert taken.value.errno == errno.EADDRINUSE
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        _until(lambda: server.log().count("the watchdog watches it from now") == 3)
        replaced = [(i, p, q) for i, p, q in STARTED.findall(server.log()) if i == index]
        assert len(replaced) == 2 and replaced[1][1] != pid and replaced[1][2] == port
        assert _samples(int(port))  # the replacement's own /metrics, on the same port
        _until(lambda: _ready_workers(server) == 2)
    finally:
        server.kill()


def test_a_worker_killed_under_load_fails_only_its_own_requests(small_model_dir: Path, tmp_path: Path) -> None:
    """8 clients, each on its own connection, while a worker is killed with SIGKILL: the requests
    that were on it fail UNAVAILABLE (retry), every answer given is exact, the worker is replaced,
    and the merged request counter never goes down."""
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    outcomes: list[str] = []
    messages: set[str] = set()
    wrong: list[float] = []
    lock = threading.Lock()
    killed = threading.Event()
    after_kill = threading.Semaphore(0)

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        # 8 connections for the kernel to spread; calls wait for a connection rather than fail fast
        with MHAClient(server.url, own_connection=True, wait_for_ready=True) as mha:
            for n in range(400):
                x = rng.standard_normal((2, 16, 32), dtype=np.float32)
                try:
                    y = mha.infer(x, timeout=30)
                except InferenceError as exc:
                    with lock:
                        outcomes.append(exc.code.name)
                        messages.add(str(exc)[:150])
                    continue
                error = relative_error(torch.from_numpy(y.copy()), attention_view(torch.from_numpy(x), weights, config))
                with lock:
                    outcomes.append("OK")
                    if error >= 1e-5:
                        wrong.append(error)
                if killed.is_set():
                    after_kill.release()
                if n > 40 and killed.is_set() and len(outcomes) > 600:
                    return

    try:
        _until(lambda: _ready_workers(server) == 2)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        _until(lambda: len(outcomes) >= 100)
        counted = [_ok(_samples(server.metrics_port))]
        # the kernel spreads the 8 connections at random: the victim is a worker that serves some
        workers = STARTED.findall(server.log())  # (index, pid, metrics port) of each
        served, index, pid = max((_ok(_samples(int(port))), index, pid) for index, pid, port in workers)
        assert served > 0, "no worker served the clients: the kill would prove nothing"
        os.kill(int(pid), signal.SIGKILL)
        killed.set()
        restarted = ("mha_worker_restarts_total", (("worker", index),))
        while _samples(server.metrics_port).get(restarted) != 1.0 or _ready_workers(server) < 2:
            counted.append(_ok(_samples(server.metrics_port)))
            assert len(counted) < 2000, f"worker {index} was never replaced"
        for _ in range(50):  # answers keep coming after the kill
            assert after_kill.acquire(timeout=60)
        for thread in threads:
            thread.join(120)
        counted.append(_ok(_samples(server.metrics_port)))
    finally:
        server.kill()
    assert wrong == [], f"{len(wrong)} answers OK and wrong"
    assert set(outcomes) <= {"OK", "UNAVAILABLE"}, sorted(set(outcomes))
    assert outcomes.count("UNAVAILABLE") <= 8, f"more failed than were on the killed worker: {sorted(messages)}"
    assert counted == sorted(counted), f"the merged counter went down: {counted[:5]} ..."


def test_log_and_trace_settings_changed_through_one_connection_hold_in_every_worker(
    small_model_dir: Path, tmp_path: Path
) -> None:
    """Changed through one connection, the settings are what every later connection reads, whichever
    worker the kernel gives it (12 new connections: all on one worker with odds of 1 in 2,048)."""
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch", "--workers", "2"])
    server.start(tmp_path / "server.log")
    try:
        _until(lambda: _ready_workers(server) == 2)
        log_change = pb.LogSettingsRequest()
        log_change.settings["log_verbose_level"].uint32_param = 1
        _stub_call(server.url, "LogSettings", log_change)
        trace_change = pb.TraceSettingRequest()
        trace_change.settings["trace_rate"].value.append("50")
        _stub_call(server.url, "TraceSetting", trace_change)
        for _ in range(12):
            logs = _stub_call(server.url, "LogSettings", pb.LogSettingsRequest())
            assert logs.settings["log_verbose_level"].uint32_param == 1  # type: ignore[attr-defined]
            traces = _stub_call(server.url, "TraceSetting", pb.TraceSettingRequest())
            assert list(traces.settings["trace_rate"].value) == ["50"]  # type: ignore[attr-defined]
    finally:
        server.kill()


def _dual_stack() -> bool:
    """Whether this machine can listen on IPv4 and IPv6 on one socket, and reach ::1."""
    import socket

    if not socket.has_dualstack_ipv6():
        return False
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _dual_stack(), reason="needs IPv6 beside IPv4 (an IPv6-only cluster's pods listen on ::)")
def test_host_any_of_both_families_serves_every_port_over_ipv4_and_ipv6(small_model_dir: Path, tmp_path: Path) -> None:
    """`--host ::`, what an IPv6-only or dual-stack cluster's pods need: gRPC, HTTP, health and
    /metrics each answer on ::1 and on 127.0.0.1, with two workers sharing the ports. Before,
    gRPC could not bind (":::8001", not "[::]:8001"), and HTTP and /metrics listened on IPv6 only."""
    (health_port,) = free_ports(1)
    args = ["--model-dir", str(small_model_dir), "--host", "::", "--health-port", str(health_port)]
    server = ServerProcess(args, workers="2")
    server.start(tmp_path / "server.log")
    try:
        assert f"infer --url [::1]:{server.port}`" in server.log()  # the ready line's command, as written
        for host in ("127.0.0.1", "[::1]"):
            with MHAClient(f"{host}:{server.port}") as client:
                assert client.infer(np.ones((1, 2, 32), np.float32)).shape == (1, 2, 32)
            with grpc.insecure_channel(f"{host}:{health_port}") as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with urllib.request.urlopen(f"http://{host}:{server.http_port}/v2/health/ready", timeout=10) as ready:
                assert ready.status == 200
            with urllib.request.urlopen(f"http://{host}:{server.metrics_port}/metrics", timeout=10) as metrics:
                assert b"mha_worker_restarts_total" in metrics.read()  # the supervisor's merged port
    finally:
        server.kill()
