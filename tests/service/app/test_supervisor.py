"""The supervisor's watchdog verdicts, on an injected clock (the real processes: tests/e2e/test_workers.py)."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics import parser as openmetrics_parser

from service.app.preflight import StartupError, check_shared_ports
from service.app.supervisor import (
    SOCKET_PATH_BYTES,
    ExemplarsMerged,
    Silence,
    Supervisor,
    Worker,
    WorkerProcesses,
    sockets_directory,
    with_shared_ports,
)
from service.protocol.peers import socket_path
from tests.support import free_ports, make_settings


def test_a_worker_is_hung_after_three_silences_once_it_has_answered() -> None:
    worker, silence = Worker(0, 9000, started=0.0), Silence(misses=3, start_s=100.0)
    verdicts = [silence.hung(worker, ok, now) for now, ok in enumerate([True, False, False, True, False, False, False])]
    assert verdicts == [False, False, False, False, False, False, True]


def test_a_worker_that_never_answers_is_hung_once_its_start_time_is_over() -> None:
    """Stuck before it could serve (a load that never ends, a deadlock at import): replaced too;
    before, a worker that had never answered was never counted silent."""
    worker, silence = Worker(0, 9000, started=50.0), Silence(misses=3, start_s=100.0)
    assert not any(silence.hung(worker, False, now) for now in (52.0, 100.0, 149.9))  # loading, however slowly
    assert silence.hung(worker, False, 150.0)


def test_a_slow_start_that_answers_in_time_is_judged_by_silences_from_then() -> None:
    worker, silence = Worker(0, 9000, started=0.0), Silence(misses=3, start_s=100.0)
    assert not silence.hung(worker, True, 99.0)
    assert not silence.hung(worker, False, 500.0) and not silence.hung(worker, False, 502.0)
    assert silence.hung(worker, False, 504.0)


def test_the_hand_over_sockets_folder_goes_when_the_supervisor_cannot_start(tmp_path: Path) -> None:
    """A supervisor whose metrics port is taken stops at once, and leaves no folder behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = make_settings(tmp_path, metrics_port=taken.getsockname()[1])
        supervisor = Supervisor(settings, ["serve"], count=2)
        assert supervisor.launch.sockets.is_dir()
        with pytest.raises(OSError):
            asyncio.run(supervisor.run())
    assert not supervisor.launch.sockets.exists()


def test_the_hand_over_sockets_go_where_their_paths_fit_a_unix_socket(tmp_path: Path) -> None:
    """A TMPDIR too long for a socket's path in it (a CI runner's, a deep container mount): the
    sockets go under the next parent given, where they can be bound; none fits, a clear refusal.
    Before, the first worker died on bind with ": AF_UNIX path too long"."""
    long = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    long.mkdir()
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        chosen = sockets_directory(16, parents=[str(long), short])
        assert chosen.parent == Path(short) and [p.name for p in long.iterdir()] == []  # the long one: removed
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(socket_path(chosen, 15)))
        assert sockets_directory(16, parents=[short]).parent == Path(short)  # the first that fits
    with pytest.raises(StartupError, match=f"at most {SOCKET_PATH_BYTES}: set TMPDIR to a shorter directory"):
        sockets_directory(2, parents=[str(long)])


def test_ports_given_as_zero_are_picked_once_for_every_worker() -> None:
    settings = make_settings(Path("unused"), grpc_port=0, http_port=None, health_port=0, metrics_port=8002)
    with with_shared_ports(settings) as picked:
        assert picked.http_port is None  # off stays off
        assert picked.metrics_port == 8002  # the supervisor's own port: it binds it itself
        assert 0 not in (picked.grpc_port, picked.health_port) and picked.grpc_port != picked.health_port
    given = make_settings(Path("unused"), grpc_port=18001, http_port=18000, health_port=18003)
    with with_shared_ports(given) as kept:
        assert kept == given


def _plain_bind(family: socket.AddressFamily, host: str, port: int) -> int:
    """errno of a bind without SO_REUSEPORT, as another process's server or client would bind; 0: bound."""
    with socket.socket(family, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            other.bind((host, port))
        except OSError as exc:
            return exc.errno or -1
    return 0


def test_picked_ports_are_held_from_other_processes_and_open_to_the_workers() -> None:
    """Workers bind the shared ports only once they have loaded (and again when one is replaced):
    until the supervisor ends, no other process can take a port picked for them, on any address,
    while listeners with SO_REUSEPORT (gRPC's and aiohttp's in the workers) bind it and are the
    only ones the kernel hands connections to."""
    settings = make_settings(Path("unused"), grpc_port=0, http_port=0, health_port=None)
    with with_shared_ports(settings) as picked:
        for port in (picked.grpc_port, picked.http_port):
            assert port
            for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                assert _plain_bind(family, host, port) == errno.EADDRINUSE, (host, port)
        servers = []
        for address in ("[::]", "0.0.0.0"):  # two workers, as gRPC binds them
            server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 1)])
            health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
            assert server.add_insecure_port(f"{address}:{picked.grpc_port}") == picked.grpc_port
            server.start()
            servers.append(server)
        try:
            for _ in range(16):  # a connection each: every one accepted, none by the held sockets
                with grpc.insecure_channel(f"127.0.0.1:{picked.grpc_port}") as channel:
                    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            for server in servers:
                server.stop(None)
        port = picked.grpc_port
    assert _plain_bind(socket.AF_INET, "127.0.0.1", port) == 0  # released with the supervisor


@pytest.mark.parametrize(
    ("ports", "says"),
    [
        ({"health_port": "grpc"}, "--grpc-port and --health-port are both"),
        ({"http_port": "grpc", "metrics_port": None}, "--grpc-port and --http-port are both"),
        ({"metrics_port": "http"}, "--http-port and --metrics-port are both"),
    ],
)
def test_workers_refuse_two_listeners_on_one_port(ports: dict, says: str) -> None:
    """With --workers every listener binds with SO_REUSEPORT: two on one port would both bind it,
    and the kernel would hand inference connections to the health or HTTP server."""
    grpc_port, http_port = free_ports(2)
    named = {"grpc": grpc_port, "http": http_port}
    given = {key: named.get(value, value) for key, value in ports.items()}
    settings = make_settings(Path("unused"), **{"grpc_port": grpc_port, "http_port": http_port, **given})
    with pytest.raises(StartupError, match=f"{says} {given[next(iter(given))]}; give each its own port"):
        check_shared_ports(settings)
    check_shared_ports(make_settings(Path("unused"), grpc_port=grpc_port, http_port=http_port))  # distinct: fine


def test_a_histogram_label_set_half_written_by_a_worker_waits_for_the_next_scrape(tmp_path: Path) -> None:
    """A worker writes a new label set's sum and buckets into its file one by one; the merge of a
    scrape that reads between them serves that set only once its +Inf bucket is there."""
    bounds = ["0.1", "1.0", "+Inf"]
    labels = {"model": "mha", "version": "1"}
    file = MmapedDict(str(tmp_path / "histogram_7.db"))

    def write(version: str, les: list[str]) -> None:
        names, values = ["model", "version"], ["mha", version]
        file.write_value(mmap_key("mha_h", "mha_h_sum", names, values, "h"), 0.5, 0.0)
        for le in les:
            file.write_value(mmap_key("mha_h", "mha_h_bucket", [*names, "le"], [*values, le], "h"), 1.0, 0.0)

    write("1", bounds)
    write("2", bounds[:2])  # the scrape came before the worker wrote +Inf
    merged = ExemplarsMerged(tmp_path)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(merged)  # type: ignore[arg-type]
    text = openmetrics.generate_latest(registry).decode()
    [family] = [f for f in openmetrics_parser.text_string_to_metric_families(text) if f.name == "mha_h"]
    assert {s.labels["version"] for s in family.samples} == {"1"}
    assert {(s.name, s.labels.get("le"), s.value) for s in family.samples if s.labels == {**labels, "le": "+Inf"}} == {
        ("mha_h_bucket", "+Inf", 3.0)
    }
    write("2", ["+Inf"])  # whole: the next scrape serves it
    [family] = [f for f in merged.collect() if f.name == "mha_h"]
    assert {s.labels["version"] for s in family.samples} == {"1", "2"}
    file.close()


def test_a_multiprocess_file_a_worker_has_just_created_waits_for_the_next_scrape(tmp_path: Path) -> None:
    """A worker that restarts creates its files empty and sizes them a moment later: a scrape in
    between serves the other workers' series (the library's reader alone fails on the empty file,
    and the whole scrape would answer 500), and the new worker's once its file is written."""
    names, values = ["model", "version"], ["mha", "1"]
    running = MmapedDict(str(tmp_path / "counter_7.db"))
    running.write_value(mmap_key("mha_c", "mha_c_total", names, values, "c"), 3.0, 0.0)
    (tmp_path / "counter_8.db").touch()  # the restarted worker's, not sized yet
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExemplarsMerged(tmp_path))  # type: ignore[arg-type]
    text = openmetrics.generate_latest(registry).decode()
    assert 'mha_c_total{model="mha",version="1"} 3.0' in text
    restarted = MmapedDict(str(tmp_path / "counter_8.db"))  # sized and written: the next scrape adds it
    restarted.write_value(mmap_key("mha_c", "mha_c_total", names, values, "c"), 2.0, 0.0)
    assert 'mha_c_total{model="mha",version="1"} 5.0' in openmetrics.generate_latest(registry).decode()
    running.close()
    restarted.close()


def test_a_worker_whose_proc_files_read_empty_leaves_only_its_own_process_series(tmp_path: Path) -> None:
    """/proc as the supervisor reads it while a worker is being reaped: its `limits` reads empty.
    The library's reader then fails; the scrape serves the other worker's series all the same."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        shutil.copy("/proc/stat", tmp_path / "stat")  # the boot time
        for sleeper, limits in zip(sleepers, [Path(f"/proc/{sleepers[0].pid}/limits").read_bytes(), b""], strict=True):
            (tmp_path / str(sleeper.pid) / "fd").mkdir(parents=True)
            shutil.copy(f"/proc/{sleeper.pid}/stat", tmp_path / str(sleeper.pid) / "stat")
            (tmp_path / str(sleeper.pid) / "limits").write_bytes(limits)
        workers = [Worker(i, 0, process=sleeper) for i, sleeper in enumerate(sleepers)]  # type: ignore[arg-type]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkerProcesses(workers, proc=str(tmp_path)))  # type: ignore[arg-type]
        text = openmetrics.generate_latest(registry).decode()
        families = {f.name: f for f in openmetrics_parser.text_string_to_metric_families(text)}
        assert {s.labels["worker"] for s in families["process_resident_memory_bytes"].samples} == {"0"}
        assert families["process_max_fds"].samples[0].value == float(os.sysconf("SC_OPEN_MAX"))
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
