"""`mha verify DIR --url`: every route a server offers, checked against the float64 references;
a route that answers wrong, or refuses, is named alone and fails the check."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.client import parity
from service.client.client import InferenceError, MHAClient
from service.client.local_routes import NOT_HERE, why_not_checked
from service.client.parity import Batched, HttpAccess, verify_server
from service.proto import grpc_service_pb2 as pb
from service.protocol import http_app
from service.protocol.shm import Regions
from tests.support import ServerThread, make_settings

ROUTES = [
    "gRPC ModelInfer",
    "gRPC rows batched",
    "gRPC ModelStreamInfer",
    "gRPC decode steps",
    "gRPC steps, reconnecting",
    "gRPC shared memory",
    "HTTP JSON",
    "HTTP binary data",
    "HTTP decode steps",
]


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, http_port=0, shared_memory="system")) as s:
        yield s


def _http(server: ServerThread) -> HttpAccess:
    return HttpAccess(f"http://127.0.0.1:{server.http_port}")


def _steps(server: ServerThread) -> float:
    labels = {"model": "mha_sequence", "version": "1"}
    return server.registry.get_sample_value("nv_inference_request_success", labels) or 0.0


def test_every_route_answers_within_the_tolerance(server: ServerThread, small_model_dir: Path) -> None:
    before = _steps(server)
    report = verify_server(server.url, small_model_dir, http=_http(server))
    assert report.ok, report.table()
    assert list(report.routes) == ROUTES and not report.skipped and not report.problems
    rows = [len(r.rows) for r in report.routes.values()]
    assert min(rows) >= 8 and len(set(rows)) == 1  # the same grid on every route
    # each sequence was sent as a prefix and then steps of 1, 2, 3, ... tokens, not whole, on both protocols
    assert _steps(server) - before >= 2 * 3 * rows[0]
    table = report.table()
    assert all(f"{route:<{parity.ROUTE_WIDTH}} ok" in table for route in ROUTES) and table.endswith("PASS")
    assert parity.ROUTE_WIDTH == max(len(route) for route in ROUTES)


def test_without_an_http_url_the_http_routes_are_said_not_checked(server: ServerThread, small_model_dir: Path) -> None:
    report = verify_server(server.url, small_model_dir, shapes=[(1, 3)])
    assert report.ok and list(report.routes) == ROUTES[:6]
    assert f"{'HTTP':<{parity.ROUTE_WIDTH}} not checked: give --http-url to check it" in report.table()


def _off_in_json() -> Callable[..., object]:
    """The HTTP app's answer writer, with JSON answers 0.1 % off: a fault put in on purpose."""
    original = http_app.response_to_http

    def off(response, binary):  # type: ignore[no-untyped-def]
        if not binary:
            response = dataclasses.replace(response, y=response.y * np.float32(1.001))
        return original(response, binary)

    return off


def test_a_route_that_answers_wrong_fails_alone(
    server: ServerThread, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP's JSON answers off by 0.1 %, on purpose: the routes answered in JSON fail, the others
    still pass, and the table gives a failed route's whole grid."""
    monkeypatch.setattr(http_app, "response_to_http", _off_in_json())
    report = verify_server(server.url, small_model_dir, shapes=[(1, 1), (2, 9)], http=_http(server))
    assert not report.ok
    json_answered = ("HTTP JSON", "HTTP decode steps")  # a step's answer is JSON too
    assert {route: r.ok for route, r in report.routes.items()} == {
        route: route not in json_answered for route in ROUTES
    }
    table = report.table()
    assert f"{'HTTP JSON':<{parity.ROUTE_WIDTH}} FAIL" in table and "\nHTTP JSON:\n" in table and table.endswith("FAIL")


def test_a_route_that_refuses_fails_with_the_servers_reason(small_model_dir: Path) -> None:
    """No room for any sequence's state: the decode steps are refused, and the report says so
    with the server's words; an HTTP port nobody listens on fails the HTTP routes."""
    with socket.socket() as closed, ServerThread(make_settings(small_model_dir, max_sequence_state_mb=0)) as s:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
        taken_port = closed.getsockname()[1]
        report = verify_server(
            s.url, small_model_dir, shapes=[(1, 4)], http=HttpAccess(f"http://127.0.0.1:{taken_port}")
        )
    failed = {route: r.problems for route, r in report.routes.items() if not r.ok}
    refused = ["gRPC decode steps", "gRPC steps, reconnecting", "HTTP JSON", "HTTP binary data", "HTTP decode steps"]
    assert list(failed) == refused, report.table()
    assert failed["gRPC decode steps"][0].startswith("refused: RESOURCE_EXHAUSTED"), failed
    assert "Cannot connect to host" in failed["HTTP JSON"][0], failed
    assert report.skipped["gRPC shared memory"] == "the server does not offer it (`--shared-memory system` turns it on)"


def test_the_shared_memory_route_answers_through_the_region_and_leaves_nothing_behind(
    server: ServerThread, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs written to the region 0.1 % off, on purpose: only that route fails (its answers are
    read from the region, not the response). Either way no region stays registered on the server,
    and no object in /dev/shm."""
    write = Regions.write

    def off(self: Regions, where: object, data: np.ndarray) -> None:
        write(self, where, data * np.float32(1.001))  # type: ignore[arg-type]

    before = set(os.listdir("/dev/shm"))
    assert verify_server(server.url, small_model_dir, shapes=[(1, 1), (2, 9)]).ok
    monkeypatch.setattr(Regions, "write", off)
    report = verify_server(server.url, small_model_dir, shapes=[(1, 1), (2, 9)])
    assert [route for route, r in report.routes.items() if not r.ok] == ["gRPC shared memory"], report.table()
    with MHAClient(server.url) as client:
        regions = client.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=10).regions
    assert not regions and set(os.listdir("/dev/shm")) == before


def test_the_routes_of_clients_on_the_servers_host_say_why_they_are_not_checked_from_elsewhere(
    server: ServerThread,
) -> None:
    """Shared memory is the host's; through a Service each new connection may reach another replica."""
    skipped: dict[str, str] = {}
    with MHAClient(server.url) as client:
        assert parity._local_routes(client, "192.0.2.1:8001", True, {}, skipped) == {}
    assert NOT_HERE == "it is for clients on the server's host: run mha verify there, with --url 127.0.0.1:PORT"
    assert skipped == {
        "gRPC steps, reconnecting": f"{NOT_HERE} (through a Service, a new connection may reach another replica)",
        "gRPC shared memory": NOT_HERE,
    }


def test_the_shared_memory_route_is_not_checked_without_the_token_or_room(
    small_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "admin").write_text("admin-secret")
    settings = make_settings(small_model_dir, shared_memory="system", admin_token_file=tmp_path / "admin")
    with ServerThread(settings) as s, MHAClient(s.url) as client:
        assert why_not_checked(client, s.url) == (
            "registering a region is a control call, refused (UNAUTHENTICATED): give the admin token"
        )
        with MHAClient(s.url, token="admin-secret") as admin:
            assert why_not_checked(admin, s.url) is None
    settings = make_settings(small_model_dir, shared_memory="system", max_shared_memory_regions=1)
    with ServerThread(settings) as s, MHAClient(s.url) as client:  # a client's region takes the only room
        taken = shared_memory.SharedMemory(create=True, size=4)
        try:
            client.register_region("a-clients", "/" + taken.name.lstrip("/"), 4)
            assert why_not_checked(client, s.url) == (
                "no room for a region of its own: RESOURCE_EXHAUSTED: this server holds its limit of 1 shared "
                "memory regions; unregister one first"
            )
        finally:
            taken.close()
            taken.unlink()


def test_a_model_served_under_another_name_and_version_is_verified_by_them(small_model_dir: Path) -> None:
    """--model-name and --model-version of the server, named to `mha verify`: every route, HTTP's
    paths included, reaches that model; a version it does not serve is refused, not guessed."""
    settings = make_settings(small_model_dir, http_port=0, model_name="attention", model_version="3")
    with ServerThread(settings) as s:
        http = HttpAccess(f"http://127.0.0.1:{s.http_port}")
        for version in ("", "3"):
            report = verify_server(
                s.url, small_model_dir, shapes=[(1, 5)], http=http, model="attention", version=version
            )
            assert report.ok and list(report.routes) == [r for r in ROUTES if r != "gRPC shared memory"], report.table()
        with pytest.raises(InferenceError) as refused:
            verify_server(s.url, small_model_dir, shapes=[(1, 5)], model="attention", version="4")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND, refused.value
        run = subprocess.run(
            [sys.executable, "-m", "service.cli", "verify", str(small_model_dir), "--url", s.url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 1 and "NOT_FOUND" in run.stderr and "mha" in run.stderr, run.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "verify", str(small_model_dir), "--model", "attention"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "give --url too" in run.stderr, run.stderr[-2000:]


def test_an_http_port_that_never_answers_fails_its_routes_in_time(
    server: ServerThread, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port that takes connections and never answers (a wedged proxy): the HTTP routes fail
    within the time allowed, saying so, and the gRPC routes pass."""
    monkeypatch.setattr(parity, "HTTP_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # never accepted: the connection is made, no answer comes
        access = HttpAccess(f"http://127.0.0.1:{silent.getsockname()[1]}")
        report = verify_server(server.url, small_model_dir, shapes=[(1, 2)], http=access)
    failed = {route: r.problems for route, r in report.routes.items() if not r.ok}
    assert list(failed) == ROUTES[6:], report.table()
    assert failed["HTTP JSON"] == ["refused: no answer within 0.5 s"]


def test_the_batched_route_has_the_server_merge_rows_of_different_requests(small_model_dir: Path) -> None:
    """Twelve rows of three inputs, each row a request of its own, sent at once: the server runs
    them in fewer batches than requests (rows of different requests, and of T 8 and 9, merged), and
    each input's rows come back as the input sent whole is answered."""
    shapes = [(5, 9), (4, 9), (3, 8)]
    inputs = [np.random.default_rng(i).standard_normal((b, t, 32), dtype=np.float32) for i, (b, t) in enumerate(shapes)]
    labels = {"model": "mha", "version": "1"}
    with ServerThread(make_settings(small_model_dir, max_queue_delay_ms=50)) as s, MHAClient(s.url) as client:

        def counts() -> tuple[float, float]:
            read = s.registry.get_sample_value
            return read("nv_inference_exec_count", labels) or 0.0, read("nv_inference_request_success", labels) or 0.0

        before = counts()
        batched = Batched(client, inputs)
        answers = [batched(x) for x in inputs]
        executions, requests = (after - was for after, was in zip(counts(), before, strict=True))
        whole = [client.infer(x) for x in inputs]
    assert requests == 12 and executions < requests, (executions, requests)
    for answer, alone in zip(answers, whole, strict=True):
        np.testing.assert_allclose(answer, alone, rtol=1e-5, atol=1e-6)


def test_mha_verify_writes_what_it_found_as_json_for_pipelines(
    server: ServerThread, small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--json FILE`: the verdict, each route's grid and problems, and what was not checked; the
    exit code agrees with it."""
    out = tmp_path / "verify.json"
    base = [
        sys.executable,
        "-m",
        "service.cli",
        "verify",
        str(small_model_dir),
        "--url",
        server.url,
        "--json",
        str(out),
    ]
    run = subprocess.run(base, capture_output=True, text=True, timeout=300)
    found = json.loads(out.read_text())
    assert run.returncode == 0 and found["ok"] is True, run.stdout + run.stderr[-2000:]
    assert list(found["routes"]) == ROUTES[:6] and found["not_checked"] == {"HTTP": "give --http-url to check it"}
    assert all(r["ok"] and len(r["grid"]) >= 8 and r["problems"] == [] for r in found["routes"].values())
    monkeypatch.setattr(http_app, "response_to_http", _off_in_json())
    http = ["--http-url", f"http://127.0.0.1:{server.http_port}"]
    run = subprocess.run([*base, *http], capture_output=True, text=True, timeout=300)
    found = json.loads(out.read_text())
    assert run.returncode == 1 and found["ok"] is False
    assert found["routes"]["HTTP JSON"]["ok"] is False and found["routes"]["HTTP JSON"]["problems"]
    assert found["routes"]["HTTP binary data"]["ok"] is True
