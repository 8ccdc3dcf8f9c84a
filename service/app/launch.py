"""`mha serve` as a child process on loopback, ready once its health says SERVING.

For tests, benchmarks and tools that need a real server process (signals, their own client
libraries; `mha tune` starts its candidates so), and the supervisor's command line for its
workers; nothing here runs on the request path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `service`
PR_SET_PDEATHSIG = 1  # prctl(2)
# gRPC waits 1 s, then 1.6 s, ... (up to 2 min) before it connects again to a port that refused: a
# server that binds between two tries would be found seconds late
QUICK_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)]
PORT_ATTEMPTS = 3  # starts of a ServerProcess whose picked ports another process took before it bound them


def serve_command(args: list[str]) -> list[str]:
    """The command line of `mha serve ARGS` in this interpreter: a server process, or a worker.
    `-P`: the working directory is not put on sys.path, so that a `service/`, `model/` or
    `export/` folder where the server is started is never imported in place of the package this
    process runs (`package_path` names where that is)."""
    return [sys.executable, "-P", "-m", "service.cli", "serve", *args]


def package_path(environ: Mapping[str, str]) -> str:
    """PYTHONPATH for a process started from this one: the folder this process's `service`
    package was imported from first, so that the child runs the same code whatever its working
    directory and however the package was installed."""
    inherited = environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(PACKAGE_ROOT), *([inherited] if inherited else [])])


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, avoid: frozenset[int] = frozenset()) -> list[int]:
    """`count` distinct ports free now, none of them in `avoid` (ports already promised to
    someone): all held at once while they are picked, so that no two are the same (one at a
    time, the kernel may hand out a port it just took back)."""
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if (port := int(s.getsockname()[1])) not in avoid:
                ports.append(port)
    return ports


def wait_for_go(fd: int) -> None:
    """Block until every writer of the inherited pipe `fd` has closed it: a worker started beside
    the first imports its libraries meanwhile, and loads the model only once the first has (the
    supervisor then closes its end), so that a model that cannot load is said once, by the first.
    OSError where `fd` is not the open read end of a pipe (the flag given by hand)."""
    if not stat.S_ISFIFO(os.fstat(fd).st_mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
        raise OSError(errno.EINVAL, "expected the read end of a pipe")
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while pipe.read(1):  # b"": end of file
            pass


def die_with_parent(parent: int) -> bool:
    """Called by a child process on itself, first thing: SIGTERM when `parent`, the process that
    started it, dies, however it dies (SIGKILL included), so that no server outlives it on the
    ports (Linux's PR_SET_PDEATHSIG). False when `parent` is not (or no longer) this process's
    parent. Set here rather than in a `preexec_fn`: Python code run between fork and exec in a
    process whose gRPC threads are at work can abort the child (gRPC's event engine)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == parent  # else the parent died before the line above took effect


class ServerProcess:
    """`mha serve` as a child process, for signals and for clients that need their own process."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        grpc_port: int = 0,
        http_port: int = 0,
        workers: str | None = "1",
    ) -> None:
        """Free loopback ports unless `grpc_port` or `http_port` names one; `workers`: one
        process unless the caller asks for more (None: what the settings or MHA_WORKERS say)."""
        self._given = (grpc_port, http_port)
        self._pick_ports()
        ports = [text for flag, port in self._port_flags().items() for text in (flag, str(port))]
        processes = ["--workers", workers] if workers is not None else []
        self.args = serve_command(["--host", "127.0.0.1", *ports, "--log-format", "json", *processes, *args])
        environment = {**os.environ, **(env or {}), "PYTHONPATH": package_path(os.environ)}
        self._spawn = partial(subprocess.Popen, env=environment, cwd=cwd, stdout=subprocess.DEVNULL, text=True)
        self.proc: subprocess.Popen[str] | None = None
        self.log_path: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        """The server's environment, to change before `start` (the same dict the start passes)."""
        environment: dict[str, str] = self._spawn.keywords["env"]
        return environment

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pick_ports(self, avoid: frozenset[int] = frozenset()) -> None:
        free_grpc, self.metrics_port, free_http = free_ports(3, avoid)
        grpc_port, http_port = self._given
        self.port, self.http_port = grpc_port or free_grpc, http_port or free_http

    def _port_flags(self) -> dict[str, int]:
        return {"--grpc-port": self.port, "--metrics-port": self.metrics_port, "--http-port": self.http_port}

    def _picked(self) -> list[int]:
        """The ports this object picked itself (not those its caller named)."""
        grpc_port, http_port = self._given
        return [self.metrics_port] + ([] if grpc_port else [self.port]) + ([] if http_port else [self.http_port])

    def start(self, log_path: Path, ready_timeout: float = 120, tied: bool = False) -> ServerProcess:
        """`tied`: the server ends with this process however it ends (call from the main thread:
        Linux ties a child to the thread that started it). A port picked free may be taken by
        another process (a port-0 listener, a connection's local port) before the server binds it,
        seconds later: the server then refuses to start, and is started again on other ports."""
        self.log_path = log_path
        attempt = 1
        while True:
            tie = ["--parent-pid", str(os.getpid())] if tied else []
            with log_path.open("w") as stderr:  # the child writes to its own copy
                self.proc = self._spawn([*self.args, *tie], stderr=stderr)
            try:
                wait_serving(self.url, ready_timeout, self.proc)
                return self
            except RuntimeError:
                if attempt == PORT_ATTEMPTS or not (lost := self._lost_ports()):
                    raise
            log.warning("port %s was taken before the server bound it; starting it on other ports", lost[0])
            self._pick_ports(avoid=frozenset(self._picked()))
            for flag, port in self._port_flags().items():  # in place: a caller may have changed the rest
                self.args[self.args.index(flag) + 1] = str(port)
            attempt += 1

    def _lost_ports(self) -> list[int]:
        """The picked ports the server's log says it could not listen on, being in use."""
        said = [line for line in self.log().splitlines() if "in use" in line]
        return [port for port in self._picked() if any(re.search(rf"\b{port}\b", line) for line in said)]

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, then SIGKILL after `timeout`: a server of several workers stops them and waits
        for them before it exits, so none outlives this call (after a SIGKILL, they would drain
        on their own for a while)."""
        if self.proc is None:
            return
        try:
            self.terminate(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def wait_serving(url: str, timeout: float, proc: subprocess.Popen[str] | None = None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(url, options=QUICK_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            with contextlib.suppress(grpc.RpcError):
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"{url} not SERVING after {timeout} s")
