"""`mha serve --workers N`: N full server processes sharing the gRPC and HTTP ports (SO_REUSEPORT),
under one supervisor, gunicorn's pre-fork model without the fork.

The supervisor starts the workers, restarts one that dies (logged and counted), forwards SIGTERM
and waits for every worker's drain. It serves the one /metrics endpoint, through
prometheus-client's multiprocess mode: each worker writes its series to files in a private
directory; counters and histograms add up over every worker that ever ran (a dead worker's stay
counted), gauges carry the worker's index and leave with their worker. Each worker's process
series (memory, CPU) are read from /proc by prometheus-client's process collector, labelled by
worker. The watchdog asks each worker's own loopback metrics port, which the supervisor keeps
bound across the worker's restarts. Each worker batches only the requests of its own connections;
each sequence has one owner worker, to which the other workers hand its steps over a Unix-domain
socket in a private directory (service/protocol/peers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.samples import Exemplar, Sample

from service.app.launch import free_ports, package_path, serve_command
from service.app.preflight import StartupError
from service.budget import MIB
from service.logs import AcceptFailures
from service.metrics import LATENCY, served_registry
from service.protocol.metrics_http import MetricsServer
from service.protocol.peers import socket_path
from service.resources import available_cpus, memory_limit_bytes
from service.settings import Settings

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus-client in a worker writes its series

MAX_RESTARTS = 5  # within RESTART_WINDOW_S: beyond it, the supervisor gives up and exits 1
RESTART_WINDOW_S = 60.0
WATCHDOG_PERIOD_S = 2.0  # how often each worker's own metrics port is asked whether it still answers
STARTING_POLL_S = 0.1  # how often a worker not yet answering is asked
WORKER_START_S = 300.0  # never answered this long after its start (loading a model on a GPU included): hung
WORKER_BASE_BYTES = 352 * MIB  # a worker's own memory, loaded and under load, its model aside
MODEL_FILE_COPIES = 3  # and per byte of the model files it serves: ORT's sessions, PyTorch's weights, step graphs
WORKERS_SHARE = 0.5  # of the memory limit, what `auto`'s workers may hold; the rest for requests and sequences
SUPERVISOR_BYTES = 64 * MIB  # the supervisor's own memory (42 MiB measured), counted in that share
SOCKET_PATH_BYTES = 107  # the longest path a Unix socket may have on Linux (sockaddr_un's 108, less the NUL)


@dataclass
class Worker:
    index: int
    metrics_port: int
    process: asyncio.subprocess.Process | None = None
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart
    answered: bool = False  # its metrics port answered since it was (re)started: the watchdog counts from then
    started: float = 0.0  # time.monotonic() of its last (re)start
    listener: socket.socket | None = None  # bound to metrics_port by the supervisor, for as long as it runs

    def inherited(self) -> tuple[int, ...]:
        """The file descriptors its process inherits: the listener it serves its own metrics on."""
        return () if self.listener is None else (self.listener.fileno(),)


def bound_listeners(count: int, avoid: Iterable[int | None]) -> list[socket.socket]:
    """A loopback socket per worker, bound to a free port (none of `avoid`, the ports the
    workers will share) and held by the supervisor for its whole run: each worker, and each
    worker that replaces it, listens on its own for the watchdog's asks, and no other process can
    take the port in between."""
    promised = {port for port in avoid if port}  # 0 and None: no port promised
    listeners: list[socket.socket] = []
    refused: list[socket.socket] = []  # held until the end, so that the kernel offers other ports
    while len(listeners) < count:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        (refused if listener.getsockname()[1] in promised else listeners).append(listener)
    for listener in refused:
        listener.close()
    return listeners


@dataclass
class Silence:
    """The watchdog's verdict on one worker from its answers, on an injected clock: hung after
    `misses` unanswered asks in a row once it has answered, or when it has never answered
    `start_s` after its start (stuck before it could serve)."""

    misses: int  # unanswered in a row (after it first answered): hung, killed, and so replaced
    start_s: float = WORKER_START_S
    _silent: int = 0

    def hung(self, worker: Worker, answered: bool, now: float) -> bool:
        worker.answered |= answered
        self._silent = 0 if answered or not worker.answered else self._silent + 1
        never = not worker.answered and now - worker.started >= self.start_s
        if self._silent >= self.misses or never:
            self._silent = 0
            return True
        return False


class WorkerProcesses:
    """Each live worker's process_* series (memory, CPU, open files), labelled by worker: a
    prometheus-client collector over the library's own ProcessCollector."""

    def __init__(self, workers: Sequence[Worker], proc: str = "/proc") -> None:
        self._workers = workers
        self._proc = proc

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for worker in self._workers:
            process = worker.process
            if process is None or process.returncode is not None:
                continue
            for family in self._read(worker.index, process.pid):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "worker": str(worker.index)}, sample.value)
        yield from families.values()

    def _read(self, index: int, pid: int) -> list[Metric]:
        """One worker's process series, or none this scrape where /proc cannot say: the library's
        reader fails (rather than skip) on a process being reaped as it reads, whose `limits`
        reads empty, and on a `limits` it does not know; the other workers' series, and every
        other family, are served all the same."""
        try:
            return list(ProcessCollector(pid=partial(int, pid), proc=self._proc, registry=None).collect())
        except (NameError, ValueError, IndexError) as exc:  # NameError: its max_fds never set
            log.debug("worker %d's process series left out of this scrape: %r", index, exc)
            return []


EXEMPLARS = "exemplars-{}.json"  # in the workers' metrics folder: a worker's latency exemplars


def exemplars_file(worker: int) -> str:
    """Where, in the workers' metrics folder, worker `worker` writes its latency exemplars."""
    return EXEMPLARS.format(worker)


class ExemplarsMerged:
    """The workers' multiprocess files merged by prometheus-client's collector, each latency
    bucket with the latest exemplar any worker wrote for it (the merge itself keeps none), and
    each histogram only with the label sets whose buckets are whole."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        exemplars = self._exemplars()
        for family in MultiProcessCollector.merge(_written_files(self.directory)):
            if family.type == "histogram":
                family.samples = _whole_histograms(family.samples)
            if family.name == LATENCY and exemplars:
                family.samples = [_with_exemplar(sample, exemplars) for sample in family.samples]
            yield family

    def _exemplars(self) -> dict[tuple[str, float], Exemplar]:
        """(method, bucket) -> the latest exemplar of any worker."""
        latest: dict[tuple[str, float], tuple[float, Exemplar]] = {}
        for path in self.directory.glob(EXEMPLARS.format("*")):
            try:
                rows = [
                    (str(m), float(le), str(trace), float(s), float(w))
                    for m, le, trace, s, w in json.loads(path.read_text())
                ]
            except (OSError, ValueError, TypeError):  # a file being replaced, or not ours: the next scrape reads it
                continue
            for method, le, trace_id, seconds, when in rows:
                if latest.get((method, le), (-1.0,))[0] < when:
                    latest[method, le] = (when, Exemplar({"trace_id": trace_id}, seconds, when))
        return {key: exemplar for key, (_, exemplar) in latest.items()}


MMAP_HEADER_BYTES = 8  # a multiprocess file's first bytes: how much of it is written


def _written_files(directory: Path) -> list[str]:
    """The workers' multiprocess files that have their header: a worker that starts (or restarts)
    creates each file empty and sizes it a moment later, and the library's reader fails on an
    empty file (the whole scrape would answer 500). A file left out now comes at the next scrape;
    a file removed meanwhile (a dead worker's live gauges) the merge itself passes over."""
    written = []
    for path in directory.glob("*.db"):
        try:
            if path.stat().st_size >= MMAP_HEADER_BYTES:
                written.append(str(path))
        except FileNotFoundError:
            continue
    return written


def _whole_histograms(samples: list[Sample]) -> list[Sample]:
    """A histogram's samples, less those of a label set whose +Inf bucket is not in the files yet:
    a worker writes a new label set's sum and buckets one by one, and a merge that reads it half
    written would serve buckets without +Inf and a count short of it (invalid OpenMetrics, which
    a scraper may refuse whole). The label set comes at the next scrape, whole."""
    whole = {_without_le(s) for s in samples if s.name.endswith("_bucket") and s.labels.get("le") == "+Inf"}
    return [s for s in samples if _without_le(s) in whole]


def _without_le(sample: Sample) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))


def _with_exemplar(sample: Sample, exemplars: dict[tuple[str, float], Exemplar]) -> Sample:
    if not sample.name.endswith("_bucket"):
        return sample
    exemplar = exemplars.get((sample.labels.get("method", ""), float(sample.labels["le"])))
    if exemplar is None:
        return sample
    return Sample(sample.name, sample.labels, sample.value, sample.timestamp, exemplar)


def sockets_directory(count: int, parents: Sequence[str | None] = (None, "/tmp")) -> Path:
    """A new directory (0700) for the hand-over sockets of `count` workers: under TMPDIR, or under
    /tmp where TMPDIR is too long a path for a socket in it (a socket cannot be bound there)."""
    for parent in parents:
        directory = Path(tempfile.mkdtemp(prefix="mha-workers-", dir=parent))
        longest = len(os.fsencode(socket_path(directory, count - 1)))
        if longest <= SOCKET_PATH_BYTES:
            if parent is not None:
                log.info("the workers' hand-over sockets are in %s: TMPDIR is too long a path for them", directory)
            return directory
        directory.rmdir()
    raise StartupError(
        f"the workers' hand-over sockets would have paths of {longest} bytes, and a Unix socket's path "
        f"takes at most {SOCKET_PATH_BYTES}: set TMPDIR to a shorter directory",
        1,
    )


class MergedMetrics:
    """The workers' metrics as the supervisor's port serves them: their multiprocess files merged,
    which workers run, and how often each was restarted."""

    def __init__(self, workers: list[Worker], directory: Path) -> None:
        self.directory = directory  # the workers' multiprocess files
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ExemplarsMerged(self.directory))  # type: ignore[arg-type]
        self.registry.register(WorkerProcesses(workers))  # type: ignore[arg-type]
        self.restarts = Counter(
            "mha_worker_restarts", "Workers restarted after they died, by worker.", ["worker"], registry=self.registry
        )
        for worker in workers:
            self.restarts.labels(str(worker.index))


class WorkerLaunch:
    """How the supervisor starts each worker: `mha serve` with the supervisor's arguments and the
    worker's own flags, its environment, and the metrics socket it inherits; with the workers'
    two private folders (hand-over sockets, multiprocess metrics), which `close` removes."""

    def __init__(
        self, argv: Sequence[str], count: int, settings: Settings, gpus: Sequence[int] = (), bind_first: bool = False
    ) -> None:
        """`bind_first`: the first worker binds the ports at once and answers NOT_SERVING while
        it loads (the default model, exported first where it is missing). The others start beside
        it and wait, their libraries imported, on a pipe (`go`) until it has loaded."""
        self.sockets = sockets_directory(count)  # first: it may refuse, and leave no folder behind
        self.metrics = Path(tempfile.mkdtemp(prefix="mha-metrics-"))  # the workers' multiprocess files
        shared = (settings.grpc_port, settings.http_port, settings.metrics_port, settings.health_port)
        self.workers = [Worker(i, s.getsockname()[1], listener=s) for i, s in enumerate(bound_listeners(count, shared))]
        self._argv, self._log_level = list(argv), settings.log_level  # `mha serve` arguments, without --workers
        self.gpus = list(gpus)  # with --workers auto on a GPU host: worker i computes on GPU gpus[i]
        self.bind_first = bind_first
        self._go: tuple[int, int] | None = os.pipe()  # (read, write): the others load once it is closed

    @property
    def own_gpus(self) -> bool:
        """Each worker computes on a GPU of its own (else they share the GPUs they see)."""
        return len(self.gpus) == len(self.workers)

    def command(self, worker: Worker, first: bool = False, wait: int | None = None) -> list[str]:
        own = worker_flags(worker.index, len(self.workers), worker.metrics_port, self.sockets)
        own += ["--worker-bind-first"] if first and self.bind_first else []
        own += ["--worker-own-gpu"] if self.own_gpus else []
        own += [arg for fd in worker.inherited() for arg in ("--worker-metrics-fd", str(fd))]
        own += [] if wait is None else ["--worker-wait-fd", str(wait)]
        return serve_command([*self._argv, *own, "--parent-pid", str(os.getpid())])  # dies with this one

    def environment(self, worker: Worker) -> dict[str, str]:
        """A worker's environment: one GPU of its own where the workers are one per GPU."""
        env = {**os.environ, "MHA_LOG_LEVEL": self._log_level, MULTIPROC_ENV: str(self.metrics)}
        env["PYTHONPATH"] = package_path(os.environ)  # the supervisor's own code, never the working directory's
        if self.own_gpus:
            env["CUDA_VISIBLE_DEVICES"] = cuda_devices(len(self.gpus), os.environ)[worker.index]  # its cuda:0
        return env

    async def start(self, worker: Worker, first: bool = False, waits: bool = False) -> None:
        """Start `worker`'s process (again, after it died), dying with the supervisor's; one that
        `waits` loads only once `go_ahead` is called."""
        wait = self._go[0] if waits and self._go is not None else None
        env, command = self.environment(worker), self.command(worker, first, wait)
        fds = (*worker.inherited(), *(() if wait is None else (wait,)))
        worker.answered, worker.started = False, time.monotonic()
        worker.process = await asyncio.create_subprocess_exec(*command, env=env, pass_fds=fds)

    def go_ahead(self) -> None:
        """The workers waiting to load go ahead: the pipe they wait on is closed."""
        if self._go is not None:
            for fd in self._go:
                os.close(fd)
            self._go = None

    def close(self) -> None:
        """The metrics sockets and the pipe closed, the private folders removed."""
        self.go_ahead()
        for listener in (w.listener for w in self.workers if w.listener is not None):
            listener.close()
        shutil.rmtree(self.sockets, ignore_errors=True)
        shutil.rmtree(self.metrics, ignore_errors=True)


class Supervisor:
    def __init__(
        self, settings: Settings, argv: Sequence[str], count: int, gpus: Sequence[int] = (), bind_first: bool = False
    ) -> None:
        """See WorkerLaunch for `bind_first`."""
        self.settings = settings
        self.launch = WorkerLaunch(argv, count, settings, gpus, bind_first)
        self.workers = self.launch.workers
        self.merged = MergedMetrics(self.workers, self.launch.metrics)
        self._stopping = False

    async def _watch(self, worker: Worker) -> None:
        """Restart the worker whenever it dies, unless the supervisor is stopping."""
        while True:
            assert worker.process is not None
            code = await worker.process.wait()
            if self._stopping:
                return
            now = time.monotonic()
            worker.restarts = [t for t in worker.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(worker.restarts) > MAX_RESTARTS:
                log.error(
                    "worker %d died %d times within %.0f s; giving up", worker.index, MAX_RESTARTS, RESTART_WINDOW_S
                )
                raise RuntimeError(f"worker {worker.index} keeps dying (last exit code {code})")
            self.merged.restarts.labels(str(worker.index)).inc()
            mark_process_dead(worker.process.pid, str(self.merged.directory))  # its gauges leave; counters stay
            log.error(
                "worker %d (pid %d) died with exit code %s; restarting it", worker.index, worker.process.pid, code
            )
            await self.launch.start(worker)
            _announce(worker)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptFailures())
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        metrics = MetricsServer(served_registry(self.merged.registry, self.settings.metrics_unloaded_s))
        try:
            if self.settings.metrics_port is not None:
                await metrics.start(self.settings.metrics_host or self.settings.host, self.settings.metrics_port)
            return await self._supervise(stop)
        finally:  # the hand-over sockets' and metrics' folders go however the supervisor ends (but SIGKILL)
            await metrics.stop()
            self.launch.close()

    async def _supervise(self, stop: asyncio.Event) -> int:
        """Start the workers, keep them running until `stop` (0) or one cannot be (1), stop them.
        They start together, and the first loads alone: where it cannot (the model), neither could
        the others, which are stopped before they load; its exit code and the one line it printed
        are the supervisor's."""
        first, *others = self.workers
        await self.launch.start(first, first=True)  # a start that fails says why in its one line
        for worker in others:  # they import their libraries while the first does, then wait
            await self.launch.start(worker, waits=True)
        loaded = partial(socket_path(self.launch.sockets, first.index).exists)  # it listens for hand-overs once loaded
        ready = loaded if self.launch.bind_first else partial(_answers, first.metrics_port, WATCHDOG_PERIOD_S)
        if (code := await _first_answer(first, stop, ready)) is not None:
            asked = first.process is not None and first.process.returncode is None  # asked to stop, or stuck
            await self._stop_all(announce=asked)
            return code
        self.launch.go_ahead()
        for worker in self.workers:
            _announce(worker)
        log.info("supervising %d workers on gRPC :%d", len(self.workers), self.settings.grpc_port)
        watchers = [asyncio.create_task(self._watch(w)) for w in self.workers]
        watchdogs = [asyncio.create_task(self._watchdog(w)) for w in self.workers]
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *watchers], return_when=asyncio.FIRST_COMPLETED)
        failed = stopper not in done
        for watchdog in watchdogs:
            watchdog.cancel()
        await self._stop_all()
        for task in [stopper, *watchers]:
            task.cancel()
        return 1 if failed else 0

    async def _watchdog(self, worker: Worker) -> None:
        """Kill a worker that is alive but answers nothing (a hung event loop), so that _watch
        replaces it, as KServe's multiprocess server does with its children."""
        window = self.settings.worker_watchdog_s  # a silent ask takes a period's wait and a period's timeout
        silence = Silence(misses=max(1, math.ceil(window / (2 * WATCHDOG_PERIOD_S))))
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S if worker.answered else STARTING_POLL_S)
            ok = await asyncio.to_thread(_answers, worker.metrics_port, WATCHDOG_PERIOD_S)
            process = worker.process
            if ok and not worker.answered:
                log.info("worker %d answers; the watchdog watches it from now", worker.index)
            if silence.hung(worker, ok, time.monotonic()) and process is not None and process.returncode is None:
                how = (
                    f"silent for {window:.0f} s (--worker-watchdog-s)"
                    if worker.answered
                    else f"never answered in the {silence.start_s:.0f} s since its start"
                )
                log.error("worker %d (pid %d) %s: killing it", worker.index, process.pid, how)
                process.kill()

    async def _stop_all(self, announce: bool = True) -> None:
        """SIGTERM to every worker, then wait for each one's drain; said at DEBUG only where the
        first worker's start failed (its line says why)."""
        self._stopping = True
        level = logging.INFO if announce else logging.DEBUG
        log.log(level, "stopping %d workers: each drains within %.0f s", len(self.workers), self.settings.grace_s)
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        for worker in self.workers:
            if worker.process is not None:
                try:
                    await asyncio.wait_for(worker.process.wait(), self.settings.grace_s + 10)
                except TimeoutError:
                    log.error("worker %d did not stop in time; killing it", worker.index)
                    worker.process.kill()
                    await worker.process.wait()


@contextlib.contextmanager
def with_shared_ports(settings: Settings) -> Iterator[Settings]:
    """The ports the workers share that were given as 0 ("pick a free one"), picked once for all
    of them (a worker picking its own would leave the clients of one port with one worker) and
    held until the supervisor ends (`reserve_port`): the workers bind them only once they have
    loaded, and a worker that replaces one binds them again; no other process takes them meanwhile."""
    ports = (settings.grpc_port, settings.http_port, settings.health_port, settings.metrics_port)
    given = frozenset(p for p in ports if p)
    with contextlib.ExitStack() as held:

        def picked(port: int | None) -> int | None:  # 0: a free one, held; None (off) and a given one stay
            return _held_free_port(held, given) if port == 0 else port

        grpc_port = settings.grpc_port or _held_free_port(held, given)
        yield replace(
            settings,
            grpc_port=grpc_port,
            http_port=picked(settings.http_port),
            health_port=picked(settings.health_port),
        )


def _held_free_port(held: contextlib.ExitStack, avoid: frozenset[int]) -> int:
    """A free port, none of `avoid`, reserved until `held` closes."""
    while True:
        port = free_ports(1, avoid)[0]
        try:
            sockets = reserve_port(port)
        except OSError as exc:  # taken between the pick and the reservation: pick again
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        for reserved in sockets:
            held.enter_context(reserved)
        return port


def reserve_port(port: int) -> list[socket.socket]:
    """Sockets that keep `port` from every other process, on every address of both families, yet
    let this user's SO_REUSEPORT listeners (the workers') bind it: bound with SO_REUSEPORT, never
    listening, so that the kernel hands them no connection. A machine without IPv6 holds IPv4."""
    with contextlib.ExitStack() as opened:
        sockets = [opened.enter_context(_reserving(socket.AF_INET, ("0.0.0.0", port)))]
        try:
            sockets.append(opened.enter_context(_reserving(socket.AF_INET6, ("::", port))))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise
        opened.pop_all()
        return sockets


def _reserving(family: socket.AddressFamily, address: tuple[str, int]) -> socket.socket:
    reserved = socket.socket(family, socket.SOCK_STREAM)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # its IPv4 twin is the other socket
            reserved.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        reserved.bind(address)
    except OSError:
        reserved.close()
        raise
    return reserved


def worker_flags(index: int, workers: int, metrics_port: int, sockets: Path) -> list[str]:
    """What makes `mha serve` worker `index` of `workers`: one process on the shared ports, its
    own loopback metrics port, the others' hand-over sockets in `sockets`."""
    return [
        *("--workers", "1", "--reuse-port", "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"),
        *("--worker-index", str(index), "--worker-peers", str(workers), "--worker-socket-dir", str(sockets)),
    ]


async def _first_answer(worker: Worker, stop: asyncio.Event, ready: Callable[[], bool]) -> int | None:
    """Wait until the started `worker` is `ready()` (None: it answers, or, bound first, it has
    loaded), exits (its exit code), is asked to stop (0) or is not ready in WORKER_START_S (1)."""
    assert worker.process is not None
    exited = asyncio.create_task(worker.process.wait())
    stopping = asyncio.create_task(stop.wait())
    try:
        while not await asyncio.to_thread(ready):
            if exited.done():
                return exited.result() or 1
            if stopping.done() or time.monotonic() - worker.started > WORKER_START_S:
                return 0 if stopping.done() else 1
            await asyncio.wait([exited, stopping], timeout=STARTING_POLL_S)
        return None  # the watchdog, started later, notes the answer itself
    finally:
        exited.cancel()
        stopping.cancel()


def _announce(worker: Worker) -> None:
    assert worker.process is not None
    log.info("worker %d started (pid %d, metrics 127.0.0.1:%d)", worker.index, worker.process.pid, worker.metrics_port)


def _answers(port: int, timeout_s: float) -> bool:
    """Does the worker's own /metrics answer within `timeout_s` (blocking: run it in a thread)?"""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def gpu_devices(dev: Path = Path("/dev")) -> list[int]:
    """The NVIDIA GPUs this host (or pod) shows (/dev/nvidia0, /dev/nvidia3, ...), by their device numbers:
    their count is what matters (cuda_devices numbers them as CUDA does)."""
    if not dev.is_dir():
        return []
    return sorted(int(d.name[6:]) for d in dev.iterdir() if d.name.startswith("nvidia") and d.name[6:].isdigit())


def cuda_devices(count: int, environ: Mapping[str, str]) -> list[str]:
    """What to put in each of `count` workers' CUDA_VISIBLE_DEVICES, one GPU each. CUDA numbers the
    devices a process can see from 0, whatever their /dev/nvidiaN numbers: a pod given the host's
    /dev/nvidia3 sees it as device 0. An inherited CUDA_VISIBLE_DEVICES (indices or GPU UUIDs)
    names them already, entry by entry."""
    inherited = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return inherited[:count] if len(inherited) >= count else [str(i) for i in range(count)]


def workers_to_start(settings: Settings, gpus: Sequence[int] | None = None) -> int:
    """--workers as this machine resolves it (`worker_count`), within its memory (`workers_in_memory`)."""
    count = worker_count(settings.workers, gpus)
    return workers_in_memory(settings.workers, count, served_bytes(settings), memory_limit_bytes())


def worker_bytes(model_bytes: int) -> int:
    """About what one worker holds once it serves model files of `model_bytes` (its resident
    memory of its own, measured: tests/e2e/test_worker_memory.py)."""
    return WORKER_BASE_BYTES + MODEL_FILE_COPIES * model_bytes


def served_bytes(settings: Settings) -> int:
    """The model files a worker loads: --model-dir's (or the default model's, once exported),
    and of each model in --model-repository its largest version."""
    if settings.model_repository is not None:
        models = [d for d in settings.model_repository.iterdir() if d.is_dir()]
        return sum(max((_folder_bytes(v) for v in m.iterdir() if v.is_dir()), default=0) for m in models)
    folder = settings.model_dir or settings.default_model_dir
    return _folder_bytes(folder) if folder is not None and folder.is_dir() else 0


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    except OSError:  # unreadable: loading it will say why
        return 0


def workers_in_memory(setting: str, count: int, model_bytes: int, limit: int) -> int:
    """The workers to start: `count`, or fewer for auto, so that the workers' own memory and their
    supervisor's keep to WORKERS_SHARE of the memory limit `limit` (at least one worker). An
    explicit count whose workers and supervisor alone would not fit in `limit` is refused
    (ValueError): they would be killed for memory, and restarted, over and over."""
    each = worker_bytes(model_bytes)
    share = max(1, int((limit * WORKERS_SHARE - SUPERVISOR_BYTES) // each))
    if setting != "auto":
        supervisor = SUPERVISOR_BYTES if count > 1 else 0  # one worker is the server itself
        if count * each + supervisor > limit:
            with_supervisor = f" and their supervisor's {supervisor / MIB:,.0f} MiB" if supervisor else ""
            raise ValueError(
                f"--workers {count}: each worker holds about {each / MIB:,.0f} MiB once it serves the model "
                f"({model_bytes / MIB:,.1f} MiB of model files), {count * each / 2**30:,.1f} GiB for {count}"
                f"{with_supervisor}; "
                f"this machine (or container) allows {limit / 2**30:,.1f} GiB. Give --workers auto ({share} "
                "here: half the memory left to requests and sequences), or more memory"
            )
        return count
    if share < count:
        log.warning(
            "--workers auto: %d workers, not one per CPU (%d): each holds about %.0f MiB, and the workers keep to "
            "half of the memory limit (%.1f GiB); the rest is for requests and sequences",
            share,
            count,
            each / MIB,
            limit / 2**30,
        )
    return min(count, share)


def worker_count(setting: str, gpus: Sequence[int] | None = None) -> int:
    """--workers: a number, or auto: one per GPU where there are GPUs, else one per CPU this
    process may use (each worker's event loop holds its own GIL: docs/benchmarks.md)."""
    if setting != "auto":
        return int(setting)
    gpus = gpu_devices() if gpus is None else gpus
    return len(gpus) if gpus else available_cpus()
