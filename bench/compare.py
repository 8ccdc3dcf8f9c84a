"""mha-serve beside Triton, KServe, MLServer and three floor servers, side by side in one run.

Every server serves the same model.onnx on this machine's CPU; one closed-loop gRPC client
(service.client.loadgen: N threads, one request at a time each) drives each in turn, client and server
sharing the cores. mha-serve runs three times: with its defaults (idle ORT threads sleep; the
backend chosen by measurement at start), with --thread-spinning (every pool busy-waits, ORT's
default, which the others keep) and with --backend ort-cpu (the same backend as the others). The floors are the
cheapest Python gRPC servers of the same protocol: `none` returns its input (protocol and copies
only), `ORT in-line` runs ONNX Runtime with its defaults on the event loop, `served graph in-line`
the graph mha-serve's ORT-CPU serves on one thread there (the cheapest server of this stack that
computes the model). KServe and MLServer run in their own
virtual environments (`make bench-servers`); a server whose environment is missing is left out
and said so. For each server: p50, p99, the slowest request and req/s per case, and the server's CPU time per request
(user + system of its whole process group, from /proc). mha-serve also runs (4, 512, 128) with
input and output in system shared memory, and that shape's in-process time on the backend that
served it is measured in this process.

Writes bench/results/compare.json and prints a table. Not a test.

`--runs N` (N > 1) interleaves instead: every server is started at once, each on its own port,
and each run visits them in turn, case by case (A B C A B C ..., the order reversed every other
run: C B A C B A ..., so that no server is always measured first), so that a loaded spell of the
machine falls on all of them; the medians over the N runs are reported, with each run's ratio of
mha-serve to KServe and to the in-line floor, and their spread, and every run's figures
(bench/results/compare_runs.json).

`--server-cpus 0 --client-cpus 1` gives the servers and the client CPUs of their own (each server
process and its threads run on the first set, the load generator on the second; the ORT pools
size themselves by the CPUs they may use): then a server whose idle threads spin cannot take the
client's CPU, as it does when they share the machine, and the comparison is the one a server
with cores of its own would see. The sets are written into the results.

`--cpu-latency-qos` holds a Linux PM QoS request of 0 µs (/dev/cpu_dma_latency, root) while it
runs: idle CPUs poll instead of halting, as on a node tuned for latency (tuned's
latency-performance profile). The results' machine line says how idle CPUs wait either way
(cpuidle driver and governor, a KVM guest's guest_halt_poll_ns): where an idle vCPU halts at once,
waking it costs more than a small request computes, and a spinning thread pays off; where idle
CPUs poll, it only takes a CPU from the client (docs/benchmarks.md).

`--cases` and `--servers` narrow an interleaved comparison to some cases and servers: with
fewer servers, each visit of mha-serve and the next of another lie closer in time, and short
runs (`--runs 30 --seconds 1`) put many such pairs in one verdict.

Every visit also records `steal_pct`: the share of the machine's CPU time the hypervisor gave to
other guests while it ran (/proc/stat), and an interleaved comparison reports its median and
maximum over the visits: on a shared VM the one number that says how loaded a spell was.

`--max-steal PCT` measures a visit again (up to three times in all, the least stolen-from kept)
while the host took more than PCT percent of the CPU time: the same rule for every server, so
that a burst of the neighbours' load does not decide a run; the summary counts the visits
measured again.

`--base REV` adds mha-serve as it was at git revision REV (checked out into a temporary worktree
and served from there: `mha-serve @REV`) to an interleaved comparison: a change's effect, before
against after in one run, where two sets measured apart differ by more than most changes do
(docs/benchmarks.md).

usage: python bench/compare.py [--seconds 5] [--runs 1] [--model-dir models/default]
                               [--server-cpus LIST --client-cpus LIST] [--cases 1,4] [--servers NAMES]
                               [--cpu-latency-qos] [--base REV] [--max-steal PCT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

import common
import grpc
import numpy as np

from service.app.launch import QUICK_RECONNECT, free_port, free_ports
from service.client.loadgen import run_load
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger("bench")
HERE = Path(__file__).parent
ROOT = HERE.parent
CASES = [  # (name, B, T, clients)
    ("(1, 64, 128) 1 client", 1, 64, 1),
    ("(1, 64, 128) 8 clients", 1, 64, 8),
    ("(1, 64, 128) 32 clients", 1, 64, 32),
    ("(4, 512, 128) 1 client", 4, 512, 1),
    ("(1, 64, 128) 8 clients, one channel", 1, 64, 8),
    ("(1, 64, 128) 32 clients, one channel", 1, 64, 32),
    ("(1, 256, 128) 8 clients", 1, 256, 8),  # longer sequences, and more rows a request: issue 63's
    ("(4, 128, 128) 8 clients", 4, 128, 8),  # cases where a Python server may lead Triton
    ("(4, 1024, 128) 1 client", 4, 1024, 1),  # the model's longest sequences: its heaviest batch of four
]
ONE_CHANNEL = "one channel"  # a case so named: its clients share one channel (one connection), as threads
# of one gRPC application do; every other case: a connection per client, as separate processes have
CLK_TCK = os.sysconf("SC_CLK_TCK")


CASE_HELP = "; ".join(f"{n} {case}" for n, (case, *_) in enumerate(CASES, 1)) + " (default: all)"


def case_list(text: str) -> list[tuple[str, int, int, int]]:
    """--cases 1,4: the cases of those numbers, in CASES' order."""
    try:
        chosen = {int(n) for n in text.split(",") if n.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected case numbers such as 1,4: {CASE_HELP}") from None
    if not chosen or not chosen <= set(range(1, len(CASES) + 1)):
        raise argparse.ArgumentTypeError(f"expected case numbers from 1 to {len(CASES)}: {CASE_HELP}")
    return [case for n, case in enumerate(CASES, 1) if n in chosen]


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group `pgid`."""
    return sum(int(fields[11]) + int(fields[12]) for _, fields in common.group_stats(pgid)) / CLK_TCK


def server_command(
    name: str, model_dir: Path, port: int, checkout: Path | None = None
) -> tuple[list[str], dict[str, str]] | None:
    """How to start server `name` on `port`, or None when its environment is not installed.
    `checkout`: where `mha-serve @REV`'s code is (python -P: imported from there, not from here)."""
    py, env = sys.executable, {"PYTHONPATH": str(checkout or ROOT)}
    if name.startswith("mha-serve"):
        mha = [py, "-P", "-m", "service.cli", "serve", "--host", "127.0.0.1", "--grpc-port", str(port)]
        mha += ["--http-port", "off", "--metrics-port", "off", "--model-dir", str(model_dir)]
        flags = [w for w in name.split()[1:] if not w.startswith("@")]  # a variant's flags follow its name
        return [*mha, "--shared-memory", "system", *flags], env
    if name.startswith("floor"):
        mode = "served" if "served" in name else "ort" if "ORT" in name else "none"
        processes = str(mha_serve_processes())  # the floor of a server of as many processes
        return [py, str(HERE / "servers" / "floor.py"), mode, str(port), str(model_dir), processes], env
    if name == "KServe + ORT":
        kserve = ROOT / ".venv-kserve" / "bin" / "python"
        ports = {"KSERVE_GRPC_PORT": str(port), "KSERVE_HTTP_PORT": str(free_port())}
        script = str(HERE / "servers" / "kserve_ort.py")
        return ([str(kserve), script, str(model_dir)], ports) if kserve.exists() else None
    if name == "Triton + ORT":
        return _triton_command(model_dir, port)
    mlserver = ROOT / ".venv-mlserver" / "bin" / "mlserver"
    return ([str(mlserver), "start", str(_mlserver_dir(model_dir, port))], {}) if mlserver.exists() else None


def mha_serve_processes() -> int:
    """The server processes `mha serve` starts with its defaults here (--workers)."""
    from service.app.supervisor import worker_count
    from service.settings import Settings

    return worker_count(Settings().workers)


def _triton_command(model_dir: Path, port: int) -> tuple[list[str], dict[str, str]] | None:
    """PyTriton's `tritonserver` (Python backend only) serving model.onnx through ORT in its
    Python backend, with Triton's dynamic batcher (max batch 8, 1 ms delay): a model repository
    in a temporary folder. The backend stub of the venv's Python is put where Triton looks."""
    site = next((ROOT / ".venv-tritonserver" / "lib").glob("python3.*/site-packages"), None)
    if site is None:
        return None
    server = site / "pytriton" / "tritonserver"
    stub = server / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        shutil.copy(server / "python_backend_stubs" / site.parent.name.removeprefix("python") / stub.name, stub)
    repository = Path(tempfile.mkdtemp(prefix="mha-triton-"))
    (repository / "mha" / "1").mkdir(parents=True)
    shutil.copy(HERE / "servers" / "triton_ort" / "model.py", repository / "mha" / "1" / "model.py")
    config = (HERE / "servers" / "triton_ort" / "config.pbtxt").read_text()
    config = config.replace("ONNX_PATH", str(model_dir / "model.onnx"))
    (repository / "mha" / "config.pbtxt").write_text(config)
    command = [str(server / "bin" / "tritonserver"), "--model-repository", str(repository)]
    command += ["--backend-directory", str(server / "backends"), "--grpc-port", str(port)]
    http, metrics = free_ports(2, avoid=frozenset({port}))  # two at once: one at a time may be the same
    command += ["--http-port", str(http), "--metrics-port", str(metrics)]
    venv_bin = site.parents[2] / "bin"  # the stub's Python finds the venv's packages through PATH, as PyTriton sets it
    env = {"LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs"), "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}
    return command, env


SERVERS = (
    "mha-serve",
    "mha-serve --thread-spinning",  # ORT's default, which KServe and the floors keep: latency for CPU
    "mha-serve --backend ort-cpu",  # the backend pinned: what the start-up measurement chose aside
    "mha-serve --backend torch",  # the other CPU backend pinned
    "mha-serve --threads 1",  # one intra-op thread: the CPUs left to gRPC and the loop
    "mha-serve behind nginx",  # a proxy that pools its upstream connections (deploy/nginx/mha-serve.conf)
    "2 replicas of mha-serve --workers 1 behind nginx",  # one process per pod, balanced request by request
    "Triton + ORT",
    "KServe + ORT",
    "MLServer + ORT",
    "floor: ORT in-line",
    "floor: served graph in-line",  # the cheapest compute known here, on the event loop
    "floor: no compute",
)
SERVER_HELP = (
    "servers by name, comma-separated, mha-serve among them: "
    + ", ".join(SERVERS)
    + ' (default: all), or "mha-serve --any-flag value"'
)


def server_list(text: str) -> tuple[str, ...]:
    """--servers "mha-serve,floor: ORT in-line": those servers, in SERVERS' order; any other
    "mha-serve --flag ..." is mha-serve with those flags, after the named ones."""
    chosen = {name.strip() for name in text.split(",") if name.strip()}
    variants = sorted(name for name in chosen - set(SERVERS) if name.startswith("mha-serve --"))
    if unknown := chosen - set(SERVERS) - set(variants):
        raise argparse.ArgumentTypeError(f"unknown servers {sorted(unknown)}: expected {SERVER_HELP}")
    if "mha-serve" not in chosen:
        raise argparse.ArgumentTypeError("mha-serve must be among the servers: the ratios are its own")
    return tuple(name for name in SERVERS if name in chosen) + tuple(variants)


def _mlserver_dir(model_dir: Path, port: int) -> Path:
    """A model repository for `mlserver start`, in a temporary folder: settings and the runtime."""
    folder = Path(tempfile.mkdtemp(prefix="mha-mlserver-"))
    (folder / "mha").mkdir()
    shutil.copy(HERE / "servers" / "mlserver_ort" / "runtime.py", folder / "mha" / "runtime.py")
    settings = {"grpc_port": port, "http_port": free_port(), "metrics_port": free_port(), "debug": False}
    uri = str(model_dir / "model.onnx")
    model = {"name": "mha", "implementation": "runtime.MHARuntime", "parameters": {"uri": uri}}
    (folder / "settings.json").write_text(json.dumps(settings))
    (folder / "mha" / "model-settings.json").write_text(json.dumps(model))
    return folder


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float = 180,
    width: int = 128,
    every_s: float = 0.5,
    log_path: Path | None = None,
) -> None:
    """Until the server at `url` answers an inference; a server that exits first is reported
    with the end of its log (`log_path`), where it says why."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(url, options=QUICK_RECONNECT) as channel:  # a refused try is retried within 0.2 s
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready{_said(log_path)}")
            try:
                if stub.ServerReady(pb.ServerReadyRequest(), timeout=2).ready:
                    x = np.zeros((1, 4, width), np.float32)
                    request = pb.ModelInferRequest(model_name="mha")
                    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
                    request.raw_input_contents.append(x.tobytes())
                    stub.ModelInfer(request, timeout=30)  # the model answers, not only the server
                    return
            except grpc.RpcError:
                pass
            time.sleep(every_s)
    raise TimeoutError(f"{url} did not become ready")


def _said(log_path: Path | None) -> str:
    """The last line of a server's log, and where the log is."""
    if log_path is None:
        return ""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    last = lines[-1].strip()[:500] if lines else "(nothing)"
    return f"; its log, {log_path}, ends: {last}"


def load_case(
    pgid: int, url: str, case: tuple[int, int, int], seconds: float, one_channel: bool = False
) -> tuple[dict[str, float], dict]:
    """One case (B, T, clients) against the server leading process group `pgid`: its p50, req/s,
    server CPU per request and the host's steal meanwhile; and the load's errors by code. The
    clients share one channel (`one_channel`), or each has a connection of its own."""
    B, T, clients = case
    before, ticks = group_cpu_seconds(pgid), common.cpu_ticks()
    result = run_load(url, clients, seconds, [T], batch=B, own_connection=not one_channel)
    cpu = group_cpu_seconds(pgid) - before
    row = {
        "p50_ms": result.p50_ms,
        "p99_ms": result.p99_ms,
        "max_ms": result.max_ms,
        "rps": result.throughput_rps,
        "server_cpu_ms_per_request": cpu / max(result.requests, 1) * 1e3,
        "steal_pct": common.steal_pct(ticks, common.cpu_ticks()),
    }
    return row, result.errors


def measure(
    name: str, command: list[str], env: dict[str, str], url: str, seconds: float, log_path: Path, cpus: set[int] | None
) -> dict:
    proc = spawn(command, env, log_path, cpus)
    rows: dict[str, dict] = {}
    try:
        wait_ready(url, proc, log_path=log_path)
        if cpus is not None and (outside := escaped(name, proc.pid, cpus)):
            rows["threads outside the servers' CPUs"] = outside  # type: ignore[assignment]
        run_load(url, 1, 1.0, [64])  # warm-up
        for case, B, T, clients in CASES:
            row, errors = load_case(proc.pid, url, (B, T, clients), seconds, ONE_CHANNEL in case)
            rows[case] = {**{k: round(v, 3) for k, v in row.items()}, "errors": errors}
            log.info("%-20s %-26s %s", name, case, rows[case])
        if name == "mha-serve":
            rows["(4, 512, 128) 1 client, shared memory"] = shared_memory_case(url, seconds)
            log.info("%-20s shared memory            %s", name, rows["(4, 512, 128) 1 client, shared memory"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return rows


def _placed(parameters: object, region: str, nbytes: int) -> None:
    parameters["shared_memory_region"].string_param = region  # type: ignore[index]
    parameters["shared_memory_byte_size"].int64_param = nbytes  # type: ignore[index]


def shared_memory_case(url: str, seconds: float) -> dict:
    """(4, 512, 128), one client, input and output in system shared memory; also the backend."""
    x = np.random.default_rng(0).standard_normal((4, 512, 128), dtype=np.float32)
    objects = [shared_memory.SharedMemory(create=True, size=x.nbytes) for _ in range(2)]
    latencies: list[float] = []
    try:
        np.ndarray(x.shape, np.float32, objects[0].buf)[:] = x
        with grpc.insecure_channel(url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for region, shm in zip(("in", "out"), objects, strict=True):
                key = "/" + shm.name.lstrip("/")
                stub.SystemSharedMemoryRegister(
                    pb.SystemSharedMemoryRegisterRequest(name=region, key=key, byte_size=x.nbytes)
                )
            request = pb.ModelInferRequest(model_name="mha")
            _placed(request.inputs.add(name="x", datatype="FP32", shape=list(x.shape)).parameters, "in", x.nbytes)
            _placed(request.outputs.add(name="y").parameters, "out", x.nbytes)
            backend = stub.ModelInfer(request, timeout=30).parameters["backend"].string_param
            stop = time.monotonic() + seconds
            while time.monotonic() < stop:
                start = time.perf_counter()
                stub.ModelInfer(request, timeout=30)
                latencies.append(time.perf_counter() - start)
            stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
    finally:
        for shm in objects:
            shm.close()
            shm.unlink()
    return {"p50_ms": round(float(np.median(latencies)) * 1e3, 3), "requests": len(latencies), "backend": backend}


def in_process_ms(model_dir: Path, backend: str, seconds: float) -> float:
    """Median time of one (4, 512, 128) run on `backend`, in this process, as the server builds it."""
    from model.checkpoint import load_checkpoint
    from service.backends.ort import OrtCpuBackend
    from service.backends.pytorch import TorchBackend

    threads = len(os.sched_getaffinity(0))
    runner: TorchBackend | OrtCpuBackend
    if backend == "torch":
        config, weights = load_checkpoint(model_dir / "weights.safetensors")
        runner = TorchBackend(config, weights, threads=threads)
    else:
        runner = OrtCpuBackend(model_dir / "model.onnx", threads)
    x = np.random.default_rng(0).standard_normal((4, 512, 128), dtype=np.float32)
    times: list[float] = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop or len(times) < 5:
        start = time.perf_counter()
        runner.run(x)
        times.append(time.perf_counter() - start)
    runner.close()
    return round(float(np.median(times[2:])) * 1e3, 3)


PROXIED = "mha-serve behind nginx"
REPLICAS = "2 replicas of mha-serve --workers 1 behind nginx"
BEHIND_NGINX = {PROXIED: ("mha-serve", 1), REPLICAS: ("mha-serve --workers 1", 2)}  # name -> (each server, how many)


class Started:
    """A server started for the interleaved runs: its process and address.

    Behind nginx (deploy/nginx/mha-serve.conf: gRPC keepalive to the upstreams, as the docs'
    proxies pool connections, each request balanced on its own), its clients connected to nginx:
    `mha-serve behind nginx` is mha-serve with its defaults; `2 replicas of mha-serve --workers 1
    behind nginx` is the same CPUs served by one process per replica, as pods of one CPU each
    would be (their process group is one, so their CPU per request is both). nginx's own CPU is
    not in the server's CPU per request."""

    def __init__(self, name: str, model_dir: Path, cpus: set[int] | None, checkout: Path | None = None) -> None:
        each, count = BEHIND_NGINX.get(name, (name, 1))
        ports = free_ports(count)
        found = [server_command(each, model_dir, port, checkout) for port in ports]
        commands = [c for c in found if c is not None]
        if len(commands) < count or (name in BEHIND_NGINX and not common.NGINX.exists()):
            raise LookupError(f"{name}: its environment is not installed (make bench-servers, make install)")
        slug = "-".join(w.strip(":-@").lower() for w in name.split()[:2] if w.strip(":-+@"))
        self.log_path = common.RESULTS / f"compare-{slug}.log"
        self.proc = spawn(*commands[0], self.log_path, cpus)
        log_of = [common.RESULTS / f"compare-{slug}-{n}.log" for n in range(1, count)]
        others = [spawn(*c, path, cpus, self.proc.pid) for c, path in zip(commands[1:], log_of, strict=True)]
        self.name, self.url = name, f"127.0.0.1:{ports[0]}"
        self.balancer: common.Balancer | None = None
        if name in BEHIND_NGINX:
            for port, proc, path in zip(ports, [self.proc, *others], [self.log_path, *log_of], strict=True):
                wait_ready(f"127.0.0.1:{port}", proc, log_path=path)
            upstreams = [SimpleNamespace(port=port, http_port=free_port()) for port in ports]  # their HTTP is off
            self.balancer = common.Balancer(common.NGINX, Path(tempfile.mkdtemp(prefix="mha-nginx-")), upstreams)
            self.url = self.balancer.start().url

    def ready(self, width: int = 128) -> None:
        """Until it answers (`wait_ready`); if it exits first, the error says what its log says."""
        wait_ready(self.url, self.proc, width=width, log_path=self.log_path)

    def case(self, B: int, T: int, clients: int, seconds: float, one_channel: bool = False) -> dict:
        return load_case(self.proc.pid, self.url, (B, T, clients), seconds, one_channel)[0]

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        with contextlib.suppress(ProcessLookupError):  # one that failed to start is gone already
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


Case = tuple[str, int, int, int]  # (name, B, T, clients)


class Visited(Protocol):
    def case(self, B: int, T: int, clients: int, seconds: float, one_channel: bool = False) -> dict: ...


STEAL_TRIES = 3  # visits of one server and case, at most, when the host takes more than --max-steal


def visit(server: Visited, case: Case, seconds: float, max_steal: float | None) -> dict:
    """One server's measurement of one case. With `max_steal`, a visit during which the host took
    more of the CPUs' time than that (steal, in percent) is measured again, up to STEAL_TRIES
    times in all, whichever the server: the one kept is the least stolen from, with how many
    `tries` were made."""
    name, B, T, clients = case
    rows = [server.case(B, T, clients, seconds, ONE_CHANNEL in name)]
    while max_steal is not None and rows[-1]["steal_pct"] > max_steal and len(rows) < STEAL_TRIES:
        rows.append(server.case(B, T, clients, seconds, ONE_CHANNEL in name))
    return {**min(rows, key=lambda row: row["steal_pct"]), "tries": len(rows)}


def interleaved(
    model_dir: Path,
    runs: int,
    seconds: float,
    cpus: set[int] | None,
    cases: list[Case] = CASES,
    names: tuple[str, ...] = SERVERS,
    checkouts: dict[str, Path] | None = None,
    max_steal: float | None = None,
) -> dict:
    """Every server up at once; `runs` rounds, each visiting every case on every server in turn.
    The servers start one after the other, each once the one before is ready: a server that
    measures at start (mha-serve's backend selection, its ORT crossover) does so on a quiet
    machine, not among the others' start-ups."""
    started: list[Started] = []
    per_run: dict[str, dict[str, list[dict]]] = {}
    escapes: dict[str, list[str]] = {}
    try:
        for name in (*names, *(checkouts or {})):
            try:
                server = Started(name, model_dir, cpus, (checkouts or {}).get(name))
            except LookupError as exc:
                log.warning("%s; left out", exc)
                continue
            started.append(server)
            server.ready()
            if cpus is not None and (outside := escaped(name, server.proc.pid, cpus)):
                escapes[name] = outside
            run_load(server.url, 1, 1.0, [64])  # warm-up
            per_run[server.name] = {case: [] for case, *_ in cases}
        for run in range(runs):
            order = started if run % 2 == 0 else started[::-1]  # no server always first, or always last
            for case in cases:
                for server in order:
                    per_run[server.name][case[0]].append(visit(server, case, seconds, max_steal))
            log.info("run %d of %d done", run + 1, runs)
    finally:
        for server in started:
            server.stop()
    return {**summarize(per_run, cases), **({"threads outside the servers' CPUs": escapes} if escapes else {})}


def spawn(
    command: list[str], env: dict[str, str], log_path: Path, cpus: set[int] | None, group: int | None = None
) -> subprocess.Popen[bytes]:
    """A server process leading its own process group (or in `group`'s), its output in `log_path`;
    on `cpus` when given, and then told how many it has (bench/servers/*: ORT's pool size, as for a
    pod of that many CPUs; mha-serve sizes its own by the CPUs it may use)."""
    pinned = {} if cpus is None else {"BENCH_ORT_THREADS": str(len(cpus))}
    with open(log_path, "w") as out, common.on_cpus(cpus):
        return subprocess.Popen(
            command,
            env={**os.environ, **env, **pinned},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0 if group is None else group,  # a group of its own, or `group`'s (one session)
        )


def escaped(name: str, pid: int, cpus: set[int]) -> list[str]:
    """The server's threads that may run outside `cpus`, said in the log: its numbers then count
    CPUs the comparison did not give it."""
    outside = common.threads_outside(pid, cpus)  # the server leads its own process group
    if outside:
        log.warning("%s: threads outside CPUs %s: %s", name, sorted(cpus), "; ".join(outside))
    return outside


def summarize(per_run: dict[str, dict[str, list[dict]]], cases: list[Case] = CASES) -> dict:
    """Medians per server and case, and mha-serve's ratio to each other server, run by run."""
    import statistics

    medians = {
        name: {
            case: {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]} for case, rows in cases.items()
        }
        for name, cases in per_run.items()
    }
    ratios: dict[str, dict[str, dict]] = {}
    ours = per_run.get("mha-serve", {})
    for other in per_run:
        if other == "mha-serve" or not ours:
            continue
        for case, _, _, clients in cases:
            metric = "p50_ms" if clients == 1 else "rps"
            each = [a[metric] / b[metric] for a, b in zip(ours[case], per_run[other][case], strict=True)]
            ratios.setdefault(other, {})[f"{case}, {metric}"] = {
                "median": round(statistics.median(each), 3),
                "runs": [round(r, 3) for r in each],
            }
            cpu = [
                a["server_cpu_ms_per_request"] / b["server_cpu_ms_per_request"]
                for a, b in zip(ours[case], per_run[other][case], strict=True)
                if b["server_cpu_ms_per_request"] > 0
            ]
            if cpu:
                ratios[other][f"{case}, server CPU/request"] = {
                    "median": round(statistics.median(cpu), 3),
                    "runs": [round(r, 3) for r in cpu],
                }
    visits = [r for cases in per_run.values() for rows in cases.values() for r in rows]
    steal = [r.get("steal_pct", 0.0) for r in visits]
    spell = {"median": round(statistics.median(steal), 1), "max": max(steal)} if steal else {}
    if retried := sum(r.get("tries", 1) > 1 for r in visits):
        spell["visits measured again"] = retried
    return {"medians": medians, "mha_serve_over": ratios, "steal_pct": spell, "every_run": per_run}


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--server-cpus", type=common.cpu_list, help="CPUs the servers run on (with --client-cpus)")
    parser.add_argument("--client-cpus", type=common.cpu_list, help="CPUs the load generator runs on")
    parser.add_argument("--cases", type=case_list, default=CASES, help=f"with --runs: cases by number, {CASE_HELP}")
    parser.add_argument("--servers", type=server_list, default=SERVERS, help=f"with --runs: {SERVER_HELP}")
    parser.add_argument(
        "--cpu-latency-qos", action="store_true", help="idle CPUs poll instead of halting while it runs (needs root)"
    )
    parser.add_argument("--base", help="with --runs: mha-serve at this git revision too (`mha-serve @REV`)")
    parser.add_argument(
        "--max-steal",
        type=float,
        help=f"with --runs: measure a visit again (up to {STEAL_TRIES} in all) while the host took more than this "
        "percent of the CPUs' time",
    )
    args = parser.parse_args()
    if (args.server_cpus is None) != (args.client_cpus is None) or (args.server_cpus or set()) & (
        args.client_cpus or set()
    ):
        parser.error("--server-cpus and --client-cpus go together, and name CPUs apart")
    if args.runs == 1 and (args.cases is not CASES or args.servers is not SERVERS or args.base or args.max_steal):
        parser.error(
            "--cases, --servers, --base and --max-steal shape an interleaved comparison: give --runs 2 or more"
        )
    model_dir, cpus = args.model_dir, args.server_cpus
    processors = f"{len(os.sched_getaffinity(0))} CPUs ({common.cpu_model()})"
    machine = f"{socket.gethostname()}: {processors}, {common.idle_policy()}"
    machine += f"; mha-serve's default processes and the floors': {mha_serve_processes()}"
    machine += "; clients on connections of their own, unless the case says one channel"
    if args.cpu_latency_qos:
        machine += ", PM QoS 0 µs held (idle CPUs poll)"
    if cpus is not None:
        machine += f"; servers on CPUs {sorted(cpus)}, the client on {sorted(args.client_cpus)}"
        os.sched_setaffinity(0, args.client_cpus)  # this thread, and the load generator's threads it starts
    with contextlib.ExitStack() as stack:
        if args.cpu_latency_qos:
            stack.enter_context(common.cpu_latency_qos())
        checkouts = {f"mha-serve @{args.base}": stack.enter_context(checkout(args.base))} if args.base else {}
        return _run(args, model_dir, cpus, machine, checkouts)


@contextlib.contextmanager
def checkout(revision: str) -> Iterator[Path]:
    """This repository at `revision`, in a temporary git worktree, removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="mha-base-")) / "tree"
    git = ["git", "-C", str(ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", "--quiet", str(where), revision], check=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(where)], check=False)
        shutil.rmtree(where.parent, ignore_errors=True)


def with_base(stack: contextlib.ExitStack, base: str | None) -> dict[str, Path | None]:
    """mha-serve from this checkout (None) and, with `base`, at that revision from a worktree kept
    until `stack` closes: by the names the results give them."""
    trees: dict[str, Path | None] = {"mha-serve": None}
    if base:
        trees[f"mha-serve @{base}"] = stack.enter_context(checkout(base))
    return trees


def _run(
    args: argparse.Namespace, model_dir: Path, cpus: set[int] | None, machine: str, checkouts: dict[str, Path]
) -> int:
    if args.runs > 1:
        summary = interleaved(
            model_dir, args.runs, args.seconds, cpus, args.cases, args.servers, checkouts, args.max_steal
        )
        common.write_json("compare_runs.json", {"machine": machine, "runs": args.runs, **summary})
        for other, cases in summary["mha_serve_over"].items():
            for case, ratio in cases.items():
                log.info("mha-serve / %s, %s: median %.3f, runs %s", other, case, ratio["median"], ratio["runs"])
        if spell := summary["steal_pct"]:
            log.info("CPU time the host took (steal) during the visits kept: %s", spell)
        return 0
    results: dict[str, object] = {"machine": machine}
    servers: dict[str, dict] = {}
    for name in SERVERS:
        port = free_port()
        command = server_command(name, model_dir, port)
        if command is None:
            log.warning("%s: its environment is not installed (make bench-servers); left out", name)
            continue
        slug = "-".join(w.strip(":-").lower() for w in name.split()[:2] if w.strip(":-+"))
        logs = common.RESULTS / f"compare-{slug}.log"
        try:
            servers[name] = measure(name, *command, f"127.0.0.1:{port}", args.seconds, logs, cpus)
        except (RuntimeError, TimeoutError) as exc:
            log.error("%s: %s", name, exc)
            servers[name] = {"error": str(exc)}
    shm = servers["mha-serve"]["(4, 512, 128) 1 client, shared memory"]
    with common.on_cpus(cpus):  # where the servers computed it
        shm["in_process_ms"] = in_process_ms(model_dir, shm["backend"], args.seconds)
    results["servers"] = servers
    common.write_json("compare.json", results)
    markdown = table(servers)
    (common.RESULTS / "compare.md").write_text(markdown)
    sys.stdout.write(markdown)
    return 0


def table(servers: dict[str, dict]) -> str:
    """The run as a markdown table: p50 for one client, req/s for many, CPU per request."""
    names = [n for n in SERVERS if n in servers and "error" not in servers[n]]
    lines = ["| case | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for case, _, _, clients in CASES:
        metric = "p50_ms" if clients == 1 else "rps"
        unit = "p50 ms" if clients == 1 else "req/s"
        lines.append(f"| {case}, {unit} | " + " | ".join(f"{servers[n][case][metric]:g}" for n in names) + " |")
    for case, *_ in CASES[:2]:
        cells = " | ".join(f"{servers[n][case]['server_cpu_ms_per_request']:g}" for n in names)
        lines.append(f"| {case}, server CPU ms/request | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
