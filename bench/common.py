"""What the benchmark scripts share: their command line, where results go, and nginx in front of
servers (the tests of the balancer use it too).

The scripts run as `python bench/NAME.py`, so this folder is on sys.path and `import common` works.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from service.app.launch import free_ports
from service.cli import model_dir_problem

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODEL = "models/default"  # what `make export` writes, each script's --model-dir unless given
ROOT = Path(__file__).resolve().parent.parent
NGINX = ROOT / ".tools" / "nginx" / "usr" / "sbin" / "nginx"  # make install unpacks Debian's package there
NGINX_CONF = ROOT / "deploy" / "nginx" / "mha-serve.conf"
# ONNX Runtime reads this once, when it is imported (after this module, in every script that imports
# it): a script's in-process sessions, like `mha serve`'s, keep no database under ~/.cache and send
# no usage events
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the script's docstring, with logging set up."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0])


def model_dir(text: str) -> Path:
    """--model-dir: an exported model's folder, resolved; refused at once, as `mha serve` refuses
    it, before any server starts (each would fail on its own, in its own log)."""
    path = Path(text).resolve()
    if (problem := model_dir_problem(path, flag="", serve=False)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return path


def rss_mib(pid: int) -> float:
    """Process `pid`'s resident memory (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no resident memory: it has exited")


def write_json(name: str, payload: object) -> Path:
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def cpu_list(text: str) -> set[int]:
    """CPUs named the way taskset and cgroups do ("0", "0-3,6"), checked against the CPUs this
    process may use."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected CPU numbers such as 0 or 0-3,6") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"{text!r}: {part.strip()!r} is not a CPU or an ascending range")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"{text!r}: CPUs {sorted(cpus - allowed)} are not among {sorted(allowed)}")
    return cpus


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """Within it, this thread, and every process and thread it starts, runs on `cpus` only
    (None: unchanged); afterwards this thread runs where it did before."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def group_stats(pgid: int) -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the name) of every live process in process group
    `pgid`: fields[2] is the group, [11] and [12] user and system CPU ticks."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended meanwhile
            continue
        if int(fields[2]) == pgid:
            yield int(entry), fields


def threads_outside(pgid: int, cpus: set[int]) -> list[str]:
    """The threads of process group `pgid` that may run on a CPU outside `cpus` ("name tid: CPUs"):
    a thread that set its own affinity (ORT's default pool pins one to every core of the machine)."""
    outside = []
    for pid, _ in group_stats(pgid):
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                allowed = os.sched_getaffinity(int(task.name))
                name = (task / "comm").read_text().strip()
            except OSError:  # a thread that ended meanwhile
                continue
            if not allowed <= cpus:
                outside.append(f"{name} {task.name}: CPUs {sorted(allowed)}")
    return outside


PROC_STAT = Path("/proc/stat")


def cpu_ticks(stat: Path = PROC_STAT) -> tuple[int, int]:
    """(all ticks, steal ticks) of the machine's CPUs so far, from /proc/stat's first line: user,
    nice, system, idle, iowait, irq, softirq and steal (guest time is counted in user already)."""
    fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields), fields[7] if len(fields) > 7 else 0


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the CPUs' time between two cpu_ticks() that the hypervisor gave to others
    (steal), in percent: on a shared VM, the measure of a spell that says how far to trust it."""
    ticks, steal = after[0] - before[0], after[1] - before[1]
    return round(100.0 * steal / ticks, 1) if ticks > 0 else 0.0


CPU_DMA_LATENCY = Path("/dev/cpu_dma_latency")  # Linux PM QoS: the deepest idle wake-up latency allowed
CPUIDLE = Path("/sys/devices/system/cpu/cpuidle")
HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def idle_policy(cpuidle: Path = CPUIDLE, halt_poll: Path = HALT_POLL) -> str:
    """How this machine's idle CPUs wait, for the results' machine line: the cpuidle driver and
    governor, and a KVM guest's halt-polling window. With guest_halt_poll_ns 0 an idle vCPU halts
    at once, and waking it costs more than a small request computes (docs/benchmarks.md)."""
    said = []
    for name in ("current_driver", "current_governor"):
        with contextlib.suppress(OSError):
            said.append((cpuidle / name).read_text().strip())
    with contextlib.suppress(OSError):
        said.append(f"guest_halt_poll_ns {halt_poll.read_text().strip()}")
    return "cpuidle " + ", ".join(said) if said else "cpuidle unknown"


CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name and whether it has AVX-512, for the results' machine line: ONNX Runtime
    and PyTorch pick their kernels by it, and a VM moved to another host changes both servers'
    times, not always alike (bench/RESULTS.md)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "CPU unknown"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's
    model = " ".join(fields.get("model name", "unknown CPU").split())
    flags = set(fields.get("flags", "").split())
    return f"{model}, {'AVX-512' if 'avx512f' in flags else 'no AVX-512'}"


@contextlib.contextmanager
def cpu_latency_qos(device: Path = CPU_DMA_LATENCY) -> Iterator[None]:
    """Within it, idle CPUs poll instead of halting (a PM QoS request of 0 µs, what tuned's
    latency-performance profile holds; it lasts while the file stays open). Needs root."""
    try:
        handle = open(device, "wb", buffering=0)  # noqa: SIM115  (held open for the whole block)
    except OSError as exc:
        raise SystemExit(f"--cpu-latency-qos: cannot open {device}: {exc.strerror} (it needs root)") from exc
    with handle:
        handle.write((0).to_bytes(4, "little", signed=True))
        yield


class Upstream(Protocol):
    """A server behind the balancer: its gRPC and HTTP ports on loopback."""

    @property
    def port(self) -> int: ...

    @property
    def http_port(self) -> int: ...


class Balancer:
    """nginx in front of server processes, configured by deploy/nginx/mha-serve.conf: gRPC and
    HTTP balanced request by request, sequences hashed on the mha-sequence-id header."""

    def __init__(self, nginx: Path, run_dir: Path, replicas: Sequence[Upstream]) -> None:
        self.nginx, self.run_dir = nginx, run_dir
        self.grpc_port, self.http_port = free_ports(2)
        grpc_servers = "\n".join(f"server 127.0.0.1:{r.port} max_fails=1 fail_timeout=10s;" for r in replicas)
        http_servers = "\n".join(f"server 127.0.0.1:{r.http_port} max_fails=1 fail_timeout=10s;" for r in replicas)
        conf = NGINX_CONF.read_text()
        for key, value in {
            "@RUN_DIR@": str(run_dir),
            "@GRPC_LISTEN@": f"127.0.0.1:{self.grpc_port}",
            "@HTTP_LISTEN@": f"127.0.0.1:{self.http_port}",
            "@GRPC_SERVERS@": grpc_servers,
            "@HTTP_SERVERS@": http_servers,
        }.items():
            conf = conf.replace(key, value)
        self.conf = run_dir / "nginx.conf"
        self.conf.write_text(conf)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout: float = 30) -> Balancer:
        foreground = "daemon off; master_process off;"
        command = [str(self.nginx), "-p", str(self.run_dir), "-c", str(self.conf), "-g", foreground]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=(self.run_dir / "stderr.log").open("w"))
        deadline = time.monotonic() + timeout
        for port in (self.grpc_port, self.http_port):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"nginx exited: {(self.run_dir / 'stderr.log').read_text()[-2000:]}")
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nginx not listening on {port} after {timeout} s")
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
