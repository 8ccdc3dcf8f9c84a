"""What a server reads at start, checked before anything heavy is loaded: the ports it will listen
on, its TLS and token files, its config.pbtxt's schedule and its tracing settings. A setting that
cannot work fails the start in one line, at once, in the supervisor of `--workers` as in a lone
server. Nothing here imports ONNX Runtime or PyTorch.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Mapping

from service.app.model_config import read_schedule
from service.budget import MIB
from service.protocol.auth import TokenFiles
from service.protocol.tls import TlsFiles
from service.scheduling import SchedulePolicy
from service.settings import Settings
from service.tracing import check_tracing

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says which setting and why.
    `exit_code` 2: a setting is wrong (usage); 1: the machine refused (a port in use)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_before_start(settings: Settings, environ: Mapping[str, str], memory_limit: int) -> None:
    """Raise StartupError (exit code 2) for a file or setting the server would refuse at start;
    warn of a setting it takes that the machine (`memory_limit`, in bytes) cannot hold."""
    if settings.max_inflight_mb * MIB > memory_limit:
        log.warning(
            "--max-inflight-mb %g is more than the memory limit (%.0f MiB): requests and answers in flight could "
            "exhaust the memory before the budget refuses them; 0 (auto) takes a quarter of the limit",
            settings.max_inflight_mb,
            memory_limit / MIB,
        )
    threads(settings)
    tls_files(settings)
    token_files(settings)
    schedule(settings)
    try:
        check_tracing(settings.otlp_endpoint, environ)
    except ValueError as exc:  # a malformed OTEL_TRACES_SAMPLER(_ARG), or OTLP endpoint
        raise StartupError(str(exc), 2) from exc


THREADS_PER_CPU = 4  # the most intra-op threads per CPU this process may use that --threads takes


def threads(settings: Settings) -> None:
    """--threads beyond a few per CPU: the threads only take turns at the CPUs, and by the
    thousand they exhaust the machine's (--threads 100000 left no process able to fork)."""
    most = THREADS_PER_CPU * settings.cpus
    if settings.threads > most:
        raise StartupError(
            f"--threads {settings.threads}: more intra-op threads than {THREADS_PER_CPU} per CPU this process may "
            f"use ({settings.cpus}) only take turns at them; give at most {most}, or 0 for one per CPU"
        )


def tls_files(settings: Settings) -> TlsFiles | None:
    """--tls-cert, --tls-key and --tls-client-ca, read the way a TLS server reads them, so that a bad
    one is named with its reason (gRPC itself only says that it failed to bind)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    try:
        return TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc


def token_files(settings: Settings) -> TokenFiles:
    """--auth-token-file and --admin-token-file, read (a problem with either is a startup error)."""
    try:
        return TokenFiles(settings.auth_token_file, settings.admin_token_file)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc


def schedule(settings: Settings) -> SchedulePolicy:
    """The stateless model's schedule policy (its config.pbtxt's, else the flags'), or StartupError
    naming the file that cannot be read or does not hold together."""
    try:
        return read_schedule(settings)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc


def check_port(host: str, port: int, flag: str) -> None:
    """Raise StartupError (exit code 1) when (host, port) cannot be listened on now."""
    if (why := _cannot_listen(host, port)) is not None:
        raise port_error(host, port, flag, f": {why}")


def check_shared_ports(settings: Settings) -> None:
    """Before --workers start: the ports they will share and the supervisor's metrics port,
    checked as one process checks its own, and each its own: two listeners given one port would
    both bind it (SO_REUSEPORT), and the kernel would hand inference connections to the other."""
    listeners = (
        ("--grpc-port", settings.host, settings.grpc_port),
        ("--http-port", settings.host, settings.http_port),
        ("--metrics-port", settings.metrics_host or settings.host, settings.metrics_port),
        ("--health-port", settings.host, settings.health_port),
    )
    taken: dict[tuple[str, int], str] = {}
    for flag, host, port in listeners:
        if port is None:  # off
            continue
        if port:  # 0 (a free one, picked per port) never collides, but its host is checked
            if (host, port) in taken:
                raise StartupError(f"{taken[host, port]} and {flag} are both {port}; give each its own port", 2)
            taken[host, port] = flag
        check_port(host, port, flag)


def host_port(host: str, port: int) -> str:
    """The address as gRPC and URLs write it: an IPv6 address in brackets ([::]:8001)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_error(host: str, port: int, flag: str, why: str) -> StartupError:
    """`why` follows the address: ": the reason", or " (the reason)"."""
    fix = f"stop what holds it, or choose another with {flag} (0 picks a free one)"
    return StartupError(f"{flag}: cannot listen on {host_port(host, port)}{why}; {fix}", 1)


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a TCP listener on (host, port) cannot be made now, or None (port 0: a free one, on an
    address that must still be this machine's)."""
    if not host:
        return "the host is empty; give an address such as 0.0.0.0 or 127.0.0.1"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host!r} is not an address of this machine ({exc.strerror})"
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT does not count
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                taken = exc.errno == errno.EADDRINUSE
                return "the port is in use by another process" if taken else (exc.strerror or str(exc))
    return None
