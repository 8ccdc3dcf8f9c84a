"""The grpc.aio server: servicer, health, reflection, TLS, auth, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from service.app.engine import Engine, build_engine, load, model_source, poll
from service.app.launch import wait_for_go
from service.app.preflight import StartupError, check_port, host_port, port_error, schedule, tls_files, token_files
from service.app.supervisor import MULTIPROC_ENV, exemplars_file
from service.batching import Clock
from service.budget import MIB, InflightBudget
from service.engine.keeper import ComputeHook
from service.engine.publishing import Publisher
from service.engine.readiness import State
from service.logs import AcceptFailures
from service.metrics import Metrics, served_registry
from service.proto import grpc_service_pb2 as pb
from service.protocol.answer import Answering, Answers
from service.protocol.auth import Access, BearerTokenInterceptor
from service.protocol.calls import Calls
from service.protocol.grpc_servicer import InferenceServicer, generic_handler
from service.protocol.handover import Handover
from service.protocol.http_app import HttpApi
from service.protocol.http_wire import quiet_client_mistakes
from service.protocol.metrics_http import MetricsServer, tcp_site
from service.protocol.peers import Broadcast, WorkerPeers, socket_path
from service.protocol.shm import Regions
from service.protocol.tls import TlsFiles
from service.protocol.workers import WorkerAnswers
from service.resources import IdleTrim, give_back_freed_memory
from service.settings import Settings
from service.tracing import TraceSettings, Tracing

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # inference.GRPCInferenceService
HEALTH_SERVICES = ("", INFERENCE_SERVICE)
FORGET_EVERY_S = 60.0  # how often a server that follows a repository looks for unloaded versions
METRICS_REFRESH_S = 0.25  # a worker of several: how often its metrics reach its multiprocess files
TRIM_EVERY_S = 2.0  # how often the server looks whether a burst is over (give_back_when_idle)
TRIM_BURST_MIB = 16  # of requests and answers held at once: a burst, whose memory goes back once it is over
PEERS_POLL_S = 0.05  # a worker of several, loaded: how often it looks for the others before it serves


@dataclass
class SideServers:
    """What serves beside the gRPC port, each None when off."""

    metrics: MetricsServer | None = None
    health: grpc.aio.Server | None = None  # plaintext, health only (--health-port)
    http: web.AppRunner | None = None


@dataclass
class Running:
    server: grpc.aio.Server
    engine: Engine
    health: health.aio.HealthServicer
    grpc_port: int
    metrics_port: int  # 0 when disabled
    side: SideServers = field(default_factory=lambda: SideServers())
    health_port: int = 0
    http_port: int = 0  # 0 when disabled
    regions: Regions | None = None
    peers: WorkerPeers | None = None  # the other workers (--workers), when there are any
    handover: Handover | None = None  # ... and where they hand this worker's steps over
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # keeps background tasks referenced


async def start(
    settings: Settings,
    registry: CollectorRegistry | None = None,
    clock: Clock | None = None,
    compute_hook: ComputeHook | None = None,
) -> Running:
    """Bind and start serving at once (health NOT_SERVING); the model loads in the background.

    A worker of several (--reuse-port, as the supervisor starts them) loads first and joins the
    shared ports only once it can serve: the kernel gives a bound worker new connections, and a
    restarting worker would otherwise answer them UNAVAILABLE while the others could serve them.
    `clock` is the batcher's (tests inject one); by default time.monotonic(). `compute_hook`: see
    ComputeHook (tests hold computes and inject failures with it).
    """
    worker = settings.worker_index if settings.worker_peers > 1 else None  # one of several: multiprocess metrics
    metrics = Metrics(
        registry if registry is not None else CollectorRegistry(auto_describe=True), worker, _exemplars(worker)
    )
    source = model_source(settings)
    peers = _peers(settings)
    others_ready = None if peers is None else peers.all_listening  # ready once every worker is
    gone = None if peers is None else peers.release  # a sequence this worker keeps no longer: owned no longer
    tell = None if peers is None else Broadcast(peers).distrust  # a backend an audit found wrong, told to the others
    engine = build_engine(
        settings, metrics, source, schedule(settings), clock, _tracing(settings), compute_hook, others_ready, gone, tell
    )
    tokens, tls = token_files(settings), tls_files(settings)  # read before a worker's long load
    credentials = None if tls is None else tls.grpc_credentials()
    access = tokens.access
    await _wait_for_first(settings.worker_wait_fd)
    if settings.reuse_port and not settings.worker_bind_first:
        try:
            await load(engine, settings)
        except Exception as exc:
            raise StartupError(f"cannot serve: {exc}", 1) from exc
    health_servicer = health.aio.HealthServicer()
    for service in HEALTH_SERVICES:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    door = engine.door
    calls = Calls(door, metrics, engine.tracing)
    kinds = settings.shared_memory.split(",")
    regions = Regions("system" in kinds, settings.max_shared_memory_regions, cuda="cuda" in kinds)
    local = Answers(door, regions)
    answers: Answering = local if peers is None else WorkerAnswers(local, peers)  # workers at the edge
    servicer = InferenceServicer(door, answers, calls)
    server = _grpc_server(grpc_options(settings), servicer, calls, access, health_servicer)
    port = _bind(server, settings.host, settings.grpc_port, credentials, "--grpc-port", settings.reuse_port)
    running = Running(server, engine, health_servicer, grpc_port=port, metrics_port=0, regions=regions, peers=peers)
    if peers is not None:  # where the other workers hand over the steps of this worker's sequences
        running.handover = Handover(local, answers, calls)
        if engine.life.state is not State.LOADING:  # else once it has loaded: its socket says it has
            await running.handover.start(socket_path(peers.directory, peers.index))
    served = _served(running, settings, metrics)
    if settings.metrics_port is not None:
        await _start_metrics(running, settings, served)
    if settings.model_repository is not None:  # versions come and go, whether or not anything scrapes
        forgetting = forget_unloaded(served, settings.metrics_unloaded_s)
        running.tasks.add(asyncio.get_running_loop().create_task(forgetting))
    running.tasks.add(asyncio.get_running_loop().create_task(give_back_when_idle(engine.budget)))
    if settings.health_port is not None:
        await _start_health_port(running, settings)
    if settings.http_port is not None:
        await _start_http(running, settings, HttpApi(door, answers, calls, access), tls)
    await server.start()
    running.tasks.add(asyncio.get_running_loop().create_task(_not_serving_when_lost(running)))
    if tls is not None:  # the certificate taken last: an alert when a renewal has not reached it
        metrics.follow(metrics.serving.tls_expiry, tls.expires)
    for watched in ([] if access.open else [tokens]) + ([] if tls is None else [tls]):  # changed: taken
        follow = watched.follow(engine.keeper.compute.clock, asyncio.Event())
        running.tasks.add(asyncio.get_running_loop().create_task(follow))
        metrics.follow(metrics.serving.files_refused.labels(files=watched.label), watched.refused_now)
    if worker is not None:  # the supervisor reads this worker's files, never its registry
        running.tasks.add(asyncio.get_running_loop().create_task(_refresh_metrics(metrics)))
    log.debug(  # a person reads "ready" (or the one line that says why not)
        "listening: gRPC %s:%d (%s), HTTP :%s, metrics :%s",
        settings.host,
        port,
        "plaintext" if tls is None else "TLS",
        running.http_port or "off",
        running.metrics_port or "off",
    )
    return running


async def _wait_for_first(fd: int | None) -> None:
    """A worker started beside the first (--worker-wait-fd) waits, its libraries imported, until the
    first has loaded."""
    if fd is None:
        return
    log.debug("waiting for the first worker to load")
    try:
        await asyncio.to_thread(wait_for_go, fd)
    except OSError as exc:
        raise StartupError(f"--worker-wait-fd {fd}: {exc.strerror}", 2) from exc
    log.debug("the first worker has loaded: loading")


def _tracing(settings: Settings) -> Tracing:
    """Traces, when --otlp-endpoint or the OTEL_* environment asks for them (off otherwise)."""
    identity = TraceSettings(
        settings.otlp_endpoint,
        "mha-serve",
        settings.replica,
        settings.worker_index,
        settings.model_name,
        settings.model_version,
    )
    try:
        return Tracing.configure(identity, os.environ)
    except ValueError as exc:  # a malformed OTEL_TRACES_SAMPLER(_ARG)
        raise StartupError(str(exc), 2) from exc


def _exemplars(worker: int | None) -> Path | None:
    """Where a worker of several writes its latency exemplars: beside its multiprocess files."""
    folder = os.environ.get(MULTIPROC_ENV) if worker is not None else None
    return Path(folder) / exemplars_file(worker) if folder and worker is not None else None


def _peers(settings: Settings) -> WorkerPeers | None:
    """The other workers, when this process is one of several (--workers): None when alone."""
    if settings.worker_peers <= 1 or settings.worker_socket_dir is None:
        return None
    return WorkerPeers(settings.worker_index, settings.worker_peers, settings.worker_socket_dir)


def _grpc_server(
    options: list[tuple[str, int]],
    servicer: InferenceServicer,
    calls: Calls,
    access: Access,
    health_servicer: health.aio.HealthServicer,
) -> grpc.aio.Server:
    """The server with every service on it: inference (through one call scope), health, reflection."""
    interceptors = [] if access.open else [BearerTokenInterceptor(access, calls.refuse)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    server.add_generic_rpc_handlers((generic_handler(servicer, calls),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((INFERENCE_SERVICE, health_name, reflection.SERVICE_NAME), server)
    return server


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: message sizes, the shared port, connection ages, keepalive
    pings; each left at gRPC's default where its setting is 0 (or off)."""
    limit = settings.max_message_mb * 1024 * 1024
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    options.append(("grpc.so_reuseport", 1 if settings.reuse_port else 0))  # shared only among --workers
    timeout = settings.grpc_keepalive_timeout_s  # grpcio drops an unanswered peer at its ping timeout, not this one
    chosen = {
        "grpc.max_connection_age_ms": settings.grpc_max_connection_age_s,  # default: as long as the client keeps it
        "grpc.max_connection_age_grace_ms": settings.grpc_max_connection_age_grace_s,  # default: no limit
        "grpc.http2.min_ping_interval_without_data_ms": settings.grpc_client_ping_interval_s,  # default: 5 min
        "grpc.keepalive_time_ms": settings.grpc_keepalive_time_s,  # default: 2 h
        "grpc.keepalive_timeout_ms": timeout,
        "grpc.http2.ping_timeout_ms": timeout,  # default: 60 s
    }
    options += [(name, _milliseconds(seconds)) for name, seconds in chosen.items() if seconds > 0]
    if settings.grpc_pings_without_calls:  # default, with no call in flight: no pings sent, one taken per 2 h
        options.append(("grpc.keepalive_permit_without_calls", 1))
    return options


def _milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _forget_version(metrics: Metrics, publish: Publisher, version: str) -> None:
    """A version unloaded for the metrics' grace: its series and its statistics go together."""
    metrics.forget(version)
    publish.forget(version)


def _served(running: Running, settings: Settings, metrics: Metrics) -> CollectorRegistry:
    """What /metrics serves; each read forgets the versions unloaded for the grace."""
    forget = partial(_forget_version, metrics, running.engine.publish)
    return served_registry(metrics.registry, settings.metrics_unloaded_s, forget)


async def forget_unloaded(
    served: CollectorRegistry, grace_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> None:
    """Reads of `served` are what forget an unloaded version's series and statistics; without a
    metrics port, or with nothing that scrapes it, none would come, and a server that follows a
    repository would keep about 86 KB of every version. Read it every FORGET_EVERY_S (the grace,
    if shorter; 1 s at least); scrapes come on the same loop, so the two never overlap."""
    period = max(1.0, min(grace_s, FORGET_EVERY_S))
    while True:
        await sleep(period)
        try:
            for _ in served.collect():
                pass
        except Exception:  # a read that fails tries again next time, as the next scrape would
            log.exception("looking for unloaded model versions failed; trying again in %.0f s", period)


async def give_back_when_idle(
    budget: InflightBudget,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    trim: Callable[[], object] = give_back_freed_memory,
) -> None:
    """Freed request and answer buffers returned to the system once a burst is over (IdleTrim,
    looked at every TRIM_EVERY_S): until then glibc keeps them for the next requests, which is
    what keeps large requests fast (docs/benchmarks.md)."""
    idle = IdleTrim(TRIM_BURST_MIB * MIB)
    while True:
        await sleep(TRIM_EVERY_S)
        if idle.due(budget.held, budget.peak_since()):
            await asyncio.to_thread(trim)
            log.debug("a burst is over: freed request and answer memory given back to the system")


async def _start_metrics(running: Running, settings: Settings, served: CollectorRegistry) -> None:
    assert settings.metrics_port is not None  # called only when the port is on
    running.side.metrics = MetricsServer(served)
    host = settings.metrics_host if settings.metrics_host is not None else settings.host
    fd = settings.worker_metrics_fd  # a worker's: the supervisor keeps it bound across the worker's restarts
    try:
        sock = None if fd is None else socket.socket(fileno=fd)
        running.metrics_port = await running.side.metrics.start(host, settings.metrics_port, sock)
    except OSError as exc:
        where = f"--metrics-port {settings.metrics_port} on {host}" if fd is None else f"--worker-metrics-fd {fd}"
        raise StartupError(f"{where}: {exc.strerror}", 1) from exc


async def _refresh_metrics(metrics: Metrics) -> None:
    """A worker's series, written to its multiprocess files every METRICS_REFRESH_S."""
    while True:
        await asyncio.sleep(METRICS_REFRESH_S)
        metrics.refresh()


async def _start_http(running: Running, settings: Settings, api: HttpApi, tls: TlsFiles | None) -> None:
    quiet_client_mistakes()
    running.side.http = web.AppRunner(api.app(), access_log=None, handle_signals=False, auto_decompress=False)
    await running.side.http.setup()
    assert settings.http_port is not None  # called only when the port is on
    context = None if tls is None else tls.http_context()
    try:
        site = tcp_site(running.side.http, settings.host, settings.http_port, context, settings.reuse_port)
        await site.start()
    except OSError as exc:
        raise StartupError(f"--http-port {settings.http_port} on {settings.host}: {exc.strerror}", 1) from exc
    running.http_port = int(running.side.http.addresses[0][1])


async def _start_health_port(running: Running, settings: Settings) -> None:
    """Health only, plaintext: kubelet's gRPC probes cannot present a client certificate. Shared
    by --workers as the inference port is: each worker's health says whether all of them serve."""
    running.side.health = grpc.aio.server(options=[("grpc.so_reuseport", 1 if settings.reuse_port else 0)])
    health_pb2_grpc.add_HealthServicer_to_server(running.health, running.side.health)
    assert settings.health_port is not None
    port, shared = settings.health_port, settings.reuse_port
    running.health_port = _bind(running.side.health, settings.host, port, None, "--health-port", shared)
    await running.side.health.start()


def _bind(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
    flag: str,
    shared: bool = False,
) -> int:
    """Listen on (host, port). A port that is taken is found first with a plain socket (unless the
    port is `shared`, --reuse-port), so that the error is one line of ours and not gRPC core's too."""
    address = host_port(host, port)
    if not shared:
        check_port(host, port, flag)
    refused = port_error(host, port, flag, " (in use, or not an address of this machine)")
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises this when it cannot listen
        raise refused from exc
    if bound == 0:
        raise refused
    return bound


async def load_and_serve(running: Running) -> None:
    """Load the model; SERVING only once it passed its self-check, every other worker (--workers)
    listens for the steps it hands over, and while it serves on the required device
    (--require-device)."""
    engine, life = running.engine, running.engine.life
    if life.state is State.LOADING:  # a worker of several has loaded before it bound its ports
        await load(engine, engine.settings)
        if running.handover is not None and running.peers is not None:  # the first worker, bound first
            await running.handover.start(socket_path(running.peers.directory, running.peers.index))
    if running.peers is not None:
        for verdict in running.peers.verdicts():
            engine.door.distrust(verdict)  # found wrong before this worker (re)started
        while not running.peers.all_listening():  # a replica serves once every worker can take its steps
            await asyncio.sleep(PEERS_POLL_S)
    life.device.on_serving = lambda ok: _health_task(running, ok)
    if engine.settings.model_control_mode == "poll":  # until draining begins
        running.tasks.add(asyncio.get_running_loop().create_task(poll(engine.keeper, life.draining)))
    ok = life.serving_ok()
    await _set_health(running, ok)
    if not ok:
        refuse_readiness(running)
        return
    log.info("%s", ready_line(running))


def ready_line(running: Running) -> str:
    """What a person reads once the server serves: where, and the command that tries it. A worker
    of several names the ports it shares and the supervisor's merged /metrics, not its own."""
    settings = running.engine.settings
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.host, settings.host)
    http = running.http_port or "off"
    health = f", health :{running.health_port}" if running.health_port else ""  # --health-port, when on
    token = f" --token-file {settings.auth_token_file}" if settings.auth_token_file else ""
    token += f" --tls-ca <the CA that signed {settings.tls_cert}>" if settings.tls_cert else ""  # the client trusts it
    try_it = f"try `{client_command()} infer --url {host_port(host, running.grpc_port)}{token}`"
    name = running.engine.life.identity.name
    if settings.worker_peers > 1:
        return (
            f"worker {settings.worker_index} ready: serving {name} on {settings.host}, gRPC :{running.grpc_port}, "
            f"HTTP :{http}{health} (shared by {settings.worker_peers} workers; metrics: the supervisor's port); "
            f"{try_it}"
        )
    metrics = running.metrics_port or "off"
    ports = f"gRPC :{running.grpc_port}, HTTP :{http}, metrics :{metrics}{health}"
    return f"ready: serving {name} on {settings.host}, {ports}; {try_it}"


def client_command() -> str:
    """The `mha` a person can run here: `mha` when it is on PATH, else its path (.venv/bin/mha in
    a checkout; the workers of `mha serve --workers N` run as `python -m service.cli`, and so
    does a server started that way); this interpreter with `-m service.cli` where none is installed."""
    invoked = Path(sys.argv[0])
    script = invoked if invoked.name == "mha" else Path(sys.executable).parent / "mha"
    if not script.is_file():
        return f"{sys.executable} -m service.cli"
    on_path = shutil.which("mha")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "mha"
    return str(script.absolute())  # runs from any directory


async def _not_serving_when_lost(running: Running) -> None:
    """A lost device: both health services NOT_SERVING, so that the liveness probe fails too."""
    await running.engine.life.device.lost.wait()
    for service in HEALTH_SERVICES:
        await running.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)


def refuse_readiness(running: Running) -> None:
    if (latest := running.engine.life.versions.latest()) is None:
        log.warning("not ready: %s", running.engine.life.readiness())
        return
    active = latest.chain.active
    log.error(
        "refusing readiness: --require-device %s, but %s on %s serves; %s",
        running.engine.settings.require_device,
        active.name,
        active.device,
        latest.selection.summary(),
    )


def _health_task(running: Running, ok: bool) -> None:
    """Health follows readiness (a fallback off the required device, or back onto it)."""
    if not ok:
        refuse_readiness(running)
    running.tasks.add(task := asyncio.get_running_loop().create_task(_set_health(running, ok)))
    task.add_done_callback(running.tasks.discard)


async def _set_health(running: Running, ok: bool) -> None:
    """The process is alive (service ""); the inference service is ready only when `ok`."""
    if running.engine.life.state is State.DRAINING or running.engine.life.device.lost.is_set():
        return  # draining and a lost device set health themselves
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await running.health.set("", serving)
    await running.health.set(INFERENCE_SERVICE, serving if ok else not_serving)


async def drain_and_stop(running: Running, grace_s: float, announce: bool = True) -> None:
    """NOT_SERVING, refuse new requests, let in-flight ones finish within the grace, stop.

    Until the in-flight requests are answered the port stays open, so that a client still
    routed here hears UNAVAILABLE with a message that says the server is draining. Not
    `announce`d (a server that never served): its steps are logged at DEBUG only.
    """
    for service in HEALTH_SERVICES:
        await running.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    running.engine.life.start_draining(announce)
    started = time.monotonic()
    if running.engine.requests.count and not await running.engine.requests.wait_idle(grace_s):
        log.warning("grace period over with %d requests in flight: stopping anyway", running.engine.requests.count)
    await running.server.stop(max(0.0, grace_s - (time.monotonic() - started)))
    await running.engine.close()
    if running.regions is not None:
        running.regions.close()
    if running.handover is not None:
        await running.handover.stop()
    if running.peers is not None:
        await running.peers.close()
    if running.side.http is not None:
        await running.side.http.cleanup()
    if running.side.metrics is not None:
        await running.side.metrics.stop()
    if running.side.health is not None:
        await running.side.health.stop(0)
    for task in running.tasks:
        task.cancel()
    running.engine.metrics.refresh()  # a worker's last requests reach its files before it exits
    running.engine.tracing.shutdown()  # the last spans, flushed
    log.log(logging.INFO if announce else logging.DEBUG, "stopped")


async def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; exit code 0 after a clean drain, 1 if the model cannot load."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptFailures())
    running = await start(settings)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader = asyncio.create_task(load_and_serve(running))
    stopper = asyncio.create_task(stop.wait())
    lost = asyncio.create_task(running.engine.life.device.lost.wait())
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        log.error("cannot serve: %s", loader.exception())  # the one line a failed start prints
        await drain_and_stop(running, 0, announce=False)
        return 1
    await asyncio.wait({stopper, lost}, return_when=asyncio.FIRST_COMPLETED)
    if lost.done() and not stop.is_set():
        log.error("exiting: the device is lost (%s)", running.engine.life.device.lost_reason)
        await drain_and_stop(running, settings.grace_s)
        return 1
    log.info("signal received: draining (grace %.1f s)", settings.grace_s)
    loader.cancel()
    lost.cancel()
    await drain_and_stop(running, settings.grace_s)
    return 0 if running.engine.life.state in (State.DRAINING, State.READY) else 1
