"""gRPC connections as the operator sets them: their age, the pings clients may send, and the
server's own keepalive pings, which drop a peer that no longer answers."""

from __future__ import annotations

import asyncio
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.client.client import MHAClient
from service.proto import grpc_service_pb2 as pb
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ManualClock, ServerThread, make_settings

SETTINGS, PING, GOAWAY, ACK = 4, 6, 7, 1  # HTTP/2 frame types, and the ACK flag
STREAM = b"/inference.GRPCInferenceService/ModelStreamInfer"


def _frame(kind: int, flags: int = 0, stream: int = 0, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _call_opened() -> bytes:
    """A HEADERS frame that opens ModelStreamInfer on stream 1 and sends nothing more (HPACK literals)."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", STREAM), (b":authority", b"test")]
    fields += [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
    block = b"".join(b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value for name, value in fields)
    return _frame(1, 4, 1, block)  # END_HEADERS


@dataclass
class SilentPeer:
    """An HTTP/2 peer that connects, acknowledges the server's settings and then answers nothing
    (a client whose host hung, or a path that silently lost its packets): when the server pinged
    it, and when the server closed the connection, in seconds from its start."""

    pinged: list[float] = field(default_factory=list)
    closed: float | None = None

    def run(self, port: int, seconds: float, with_call: bool) -> SilentPeer:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            call = _call_opened() if with_call else b""
            conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(SETTINGS) + call)
            conn.settimeout(0.05)
            pending = b""
            while (now := time.monotonic() - started) < seconds:
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    self.closed = now
                    return self
                pending = self._read(conn, pending + data, now)
        return self

    def _read(self, conn: socket.socket, data: bytes, now: float) -> bytes:
        while len(data) >= 9 and len(data) >= 9 + (size := int.from_bytes(data[:3], "big")):
            kind, flags, data = data[3], data[4], data[9 + size :]
            if kind == SETTINGS and not flags & ACK:
                conn.sendall(_frame(SETTINGS, ACK))
            if kind == PING and not flags & ACK:
                self.pinged.append(now)  # and never acknowledged
        return data


def _peers(port: int, call_s: float, idle_s: float) -> tuple[SilentPeer, SilentPeer]:
    """A silent peer with a call open (watched for up to `call_s`) and one without (`idle_s`), side by side."""
    with_call, idle = SilentPeer(), SilentPeer()
    threads = [threading.Thread(target=with_call.run, args=(port, call_s, True))]
    threads.append(threading.Thread(target=idle.run, args=(port, idle_s, False)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(call_s, idle_s) + 10)
    return with_call, idle


def _port(server: ServerThread) -> int:
    return int(server.url.rsplit(":", 1)[1])


def test_gRPCs_defaults_never_ping_a_silent_peer_soon(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir)) as server:
        with_call, idle = _peers(_port(server), 2.0, 2.0)
    assert (with_call.pinged, with_call.closed, idle.pinged, idle.closed) == ([], None, [], None)


def test_a_peer_that_stops_answering_pings_is_dropped_and_a_live_one_kept(small_model_dir: Path) -> None:
    """--grpc-keepalive-time-s and --grpc-keepalive-timeout-s: a connection silent for the time is
    pinged, and one whose ping goes unanswered for the timeout is closed, its call with it (grpcio
    drops it at its ping timeout, 60 s, unless that is set too). A connection with no call in
    flight is pinged only with --grpc-pings-without-calls. A client that answers keeps its stream."""
    keepalive = {"grpc_keepalive_time_s": 0.2, "grpc_keepalive_timeout_s": 0.5}
    with ServerThread(make_settings(small_model_dir, **keepalive)) as server:
        live = threading.Thread(target=_live_stream_outlasts_pings, args=(server, 2.0))
        live.start()
        with_call, idle = _peers(_port(server), 8.0, 2.0)
        live.join(30)
    assert with_call.pinged and with_call.pinged[0] < 2.0, with_call
    assert with_call.closed is not None and with_call.closed < 8.0, "the silent peer was not dropped"
    assert (idle.pinged, idle.closed) == ([], None)
    with ServerThread(make_settings(small_model_dir, **keepalive, grpc_pings_without_calls=True)) as server:
        idle = SilentPeer().run(_port(server), 8.0, with_call=False)
    assert idle.pinged and idle.closed is not None and idle.closed < 8.0, idle


def _live_stream_outlasts_pings(server: ServerThread, idle_s: float) -> None:
    requests: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
    with MHAClient(server.url) as client:
        stream = client.stub.ModelStreamInfer(iter(requests.get, None), timeout=30)
        for name in ("before", "after"):
            requests.put(encode_infer_request(np.ones((1, 2, 32), np.float32), request_id=name))
            assert next(stream).infer_response.id == name
            threading.Event().wait(idle_s)  # the server pings the stream's connection meanwhile
        requests.put(None)


def test_a_stream_is_closed_once_its_connection_is_past_its_age_and_grace(small_model_dir: Path) -> None:
    """--grpc-max-connection-age-grace-s bounds how long calls may go on once their connection is
    asked to go: a stream left open is then ended UNAVAILABLE, which a client retries elsewhere."""
    settings = make_settings(small_model_dir, grpc_max_connection_age_s=0.3, grpc_max_connection_age_grace_s=0.3)
    requests: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        stream = client.stub.ModelStreamInfer(iter(requests.get, None), timeout=20)
        requests.put(encode_infer_request(np.ones((1, 2, 32), np.float32), request_id="first"))
        assert next(stream).infer_response.id == "first"
        with pytest.raises(grpc.RpcError) as ended:  # no more requests: the stream waits, open, until closed
            next(stream)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        requests.put(None)


def _dropped_while_idle_pinging(server: ServerThread, within_s: float) -> bool:
    """A client that pings every 0.1 s with no call in flight: whether the server dropped its
    connection (GOAWAY too_many_pings, as gRPC's default server does) within `within_s`. An aio
    channel: a sync one's `subscribe` leaves a polling thread that fails once the channel closes."""
    options = [
        ("grpc.keepalive_time_ms", 100),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]

    async def dropped() -> bool:
        async with grpc.aio.insecure_channel(server.url, options=options) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected
            try:
                await asyncio.wait_for(_left_ready(channel), within_s)
                left = True
            except TimeoutError:
                left = False
            await health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # served either way
            return left

    return asyncio.run(dropped())


async def _left_ready(channel: grpc.aio.Channel) -> None:
    while (state := channel.get_state()) is grpc.ChannelConnectivity.READY:
        await channel.wait_for_state_change(state)


def test_clients_keepalive_pings_are_taken_as_the_settings_allow(small_model_dir: Path) -> None:
    """--grpc-client-ping-interval-s and --grpc-pings-without-calls: a client that pings an
    idle connection often (to keep a NAT's or a balancer's idle timeout from closing it) is cut off
    by gRPC's defaults, and keeps its connection where the settings allow its pings."""
    with ServerThread(make_settings(small_model_dir)) as server:
        assert _dropped_while_idle_pinging(server, 30.0)  # about 3 s here
    allowed = make_settings(small_model_dir, grpc_client_ping_interval_s=0.05, grpc_pings_without_calls=True)
    with ServerThread(allowed) as server:
        assert not _dropped_while_idle_pinging(server, 6.0)


def _answered(conn: socket.socket) -> dict[str, str]:
    """GET /v2/health/live on an open connection: the answer's headers (names in lower case)."""
    conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/1.1 200"), lines[0]
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += conn.recv(4096)
    return headers


@pytest.mark.parametrize("age", [10.0, 0.0])
def test_an_http_connection_past_its_age_is_asked_to_close(small_model_dir: Path, age: float) -> None:
    """--http-max-connection-age-s: a keep-alive connection's answers once it is past its age
    (10 s, varied by a tenth either way, on the server's clock) say `Connection: close`, and the
    server closes it; its client's next connection starts a new age. 0, the default: never."""
    clock = ManualClock()
    settings = make_settings(small_model_dir, http_port=0, http_max_connection_age_s=age)
    with ServerThread(settings, clock=clock) as server:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as conn:
            assert "connection" not in _answered(conn)  # kept alive, HTTP/1.1's default
            clock.t += 8.9  # under its age less a tenth
            assert "connection" not in _answered(conn)  # the same connection, still kept
            clock.t += 2.2  # past its age and a tenth
            if age == 0:
                assert "connection" not in _answered(conn)
                return
            assert _answered(conn)["connection"] == "close"
            assert conn.recv(1) == b"", "the server closed it"
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as conn:
            assert "connection" not in _answered(conn)  # a new connection, a new age
