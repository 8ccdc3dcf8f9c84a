"""/metrics over HTTP on the server's event loop: no thread per connection, one path, bounded.

prometheus-client's own server starts a thread per connection (a thousand idle connections
made a thousand threads). Here each connection is a coroutine that must send its request head
within `READ_TIMEOUT_S`, gets one answer and is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8192


class MetricsServer:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (useful with port 0)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        return self.address[1]

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            # off the event loop: a registry's collectors may block (the supervisor's scrape its workers)
            writer.write(await asyncio.to_thread(self._answer, head))
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # idle, oversized or gone: close it
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), READ_TIMEOUT_S)

    def _answer(self, head: bytes) -> bytes:
        request_line, *headers = head.split(b"\r\n")
        parts = request_line.split()
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
            return _response(405, b"text/plain; charset=utf-8", b"only GET /metrics is served\n")
        path = parts[1].split(b"?", 1)[0]
        if path != b"/metrics":
            return _response(404, b"text/plain; charset=utf-8", b"not found: this port serves GET /metrics only\n")
        # prometheus-client's own negotiation: OpenMetrics (with exemplars: trace ids) when asked for
        encoder, content_type = choose_encoder(_header(headers, b"accept"))
        body = encoder(self._registry)
        return _response(200, content_type.encode(), b"" if parts[0] == b"HEAD" else body, len(body))


def _header(headers: list[bytes], wanted: bytes) -> str:
    """A request header's value ("" when absent), its name matched in any case."""
    for line in headers:
        name, _, value = line.partition(b":")
        if name.strip().lower() == wanted:
            return value.strip().decode("latin-1")
    return ""


def _response(status: int, content_type: bytes, body: bytes, length: int | None = None) -> bytes:
    reason = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}[status]
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
        status,
        reason,
        content_type,
        len(body) if length is None else length,
    )
    return head + body
