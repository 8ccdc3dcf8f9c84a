"""ServerProcess (service/app/launch.py): a real `mha serve` child process, as tests, benchmarks
and `mha tune` start one."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from service.app.launch import ServerProcess


@contextmanager
def _listening_on(port: int) -> Iterator[None]:
    """Another process's listener on `port`, as one that took it after it was picked."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        yield


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(small_model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch"])
    taken = server.http_port
    with _listening_on(taken):
        server.start(tmp_path / "server.log")
        try:
            assert server.http_port != taken and str(server.http_port) in server.args
            with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/ready", timeout=10) as ready:
                assert ready.status == 200
        finally:
            server.stop()


def test_a_port_the_caller_named_is_never_swapped_for_another(small_model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch"])
    named = server.http_port
    server = ServerProcess(["--model-dir", str(small_model_dir), "--backend", "torch"], http_port=named)
    with _listening_on(named), pytest.raises(RuntimeError, match="exited with 1 before it was ready"):
        server.start(tmp_path / "server.log")
    assert server.http_port == named and "in use" in server.log()
