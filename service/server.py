"""The grpc.aio server: servicer, health, reflection, TLS, auth, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from service.auth import BearerTokenInterceptor, read_token
from service.batcher import Clock
from service.calls import Calls
from service.core import InferenceCore, State
from service.handlers import generic_handler
from service.metrics import Metrics
from service.proto import grpc_service_pb2 as pb
from service.servicer import InferenceServicer
from service.settings import Settings

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # inference.GRPCInferenceService
HEALTH_SERVICES = ("", INFERENCE_SERVICE)


@dataclass
class Running:
    server: grpc.aio.Server
    core: InferenceCore
    health: health.aio.HealthServicer
    grpc_port: int
    metrics_port: int  # 0 when disabled
    metrics_server: object | None = None


def _credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


async def start(settings: Settings, registry: CollectorRegistry | None = None, clock: Clock | None = None) -> Running:
    """Bind and start serving at once (health NOT_SERVING); the model loads in the background.

    `clock` is the batcher's (tests inject one); by default time.monotonic().
    """
    metrics = Metrics(registry if registry is not None else CollectorRegistry(auto_describe=True))
    core = InferenceCore(settings, metrics, clock)
    calls = Calls(core)
    interceptors = []
    if settings.auth_token_file is not None:
        interceptors.append(BearerTokenInterceptor(read_token(settings.auth_token_file), calls.refuse))
    limit = settings.max_message_mb * 1024 * 1024
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((generic_handler(InferenceServicer(core, calls), calls),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (INFERENCE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{settings.host}:{settings.grpc_port}"
    credentials = _credentials(settings)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC to {address}")
    for service in HEALTH_SERVICES:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    running = Running(server=server, core=core, health=health_servicer, grpc_port=port, metrics_port=0)
    if settings.metrics_port:
        running.metrics_server, _ = start_http_server(
            settings.metrics_port, addr=settings.host, registry=metrics.registry
        )
        running.metrics_port = running.metrics_server.server_port  # type: ignore[attr-defined]
    log.info(
        "listening: gRPC %s:%d (%s), metrics :%s",
        settings.host,
        port,
        "TLS" if credentials else "plaintext",
        running.metrics_port or "off",
    )
    return running


async def load_and_serve(running: Running) -> None:
    """Load the model; SERVING only once it passed its self-check."""
    await running.core.load()
    for service in HEALTH_SERVICES:
        await running.health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("ready: model loaded and self-checked; health SERVING")


async def drain_and_stop(running: Running, grace_s: float) -> None:
    """NOT_SERVING, refuse new requests, let in-flight ones finish within the grace, stop.

    Until the in-flight requests are answered the port stays open, so that a client still
    routed here hears UNAVAILABLE with a message that says the server is draining.
    """
    for service in HEALTH_SERVICES:
        await running.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    running.core.start_draining()
    started = time.monotonic()
    await running.core.wait_idle(grace_s)
    await running.server.stop(max(0.0, grace_s - (time.monotonic() - started)))
    await running.core.close()
    if running.metrics_server is not None:
        running.metrics_server.shutdown()  # type: ignore[attr-defined]
    log.info("stopped")


async def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; exit code 0 after a clean drain, 1 if the model cannot load."""
    running = await start(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader = asyncio.create_task(load_and_serve(running))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        log.error("cannot serve: %s", loader.exception())
        await drain_and_stop(running, 0)
        return 1
    if not stop.is_set():
        await stopper
    log.info("signal received: draining (grace %.1f s)", settings.grace_s)
    loader.cancel()
    await drain_and_stop(running, settings.grace_s)
    return 0 if running.core.state in (State.DRAINING, State.READY) else 1
