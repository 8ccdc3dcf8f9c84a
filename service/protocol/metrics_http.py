"""/metrics over HTTP: prometheus-client's aiohttp handler, on the server's event loop (no thread
per connection), one path. A connection that sends nothing, or keeps one open between scrapes,
is closed after `IDLE_S`; a request head is bounded by aiohttp's line and header limits.
"""

from __future__ import annotations

import socket
import ssl

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

IDLE_S = 5.0  # a connection idle this long is closed
MAX_LINE = 4096  # bytes of the request line and of each header
MAX_HEADERS = 32


@web.middleware
async def _plain_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """404 and 405 in words that name the one thing this port serves."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.Response(status=404, text="not found: this port serves GET /metrics only\n")
    except web.HTTPMethodNotAllowed:
        return web.Response(status=405, text="only GET /metrics is served\n", headers={"Allow": "GET, HEAD"})


def tcp_site(
    runner: web.BaseRunner, host: str, port: int, ssl_context: ssl.SSLContext | None = None, reuse_port: bool = False
) -> web.BaseSite:
    """A listener on (host, port), for aiohttp. "::" is every address of both families on one
    socket, as gRPC's [::] is: asyncio alone would listen on IPv6 only. Raises OSError when the
    address cannot be bound."""
    if host == "::" and socket.has_dualstack_ipv6():
        sock = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=reuse_port)
        return web.SockSite(runner, sock, ssl_context=ssl_context)
    return web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry) -> None:
        app = web.Application(middlewares=[_plain_errors])
        app.router.add_get("/metrics", make_aiohttp_handler(registry, disable_compression=True))
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=IDLE_S,
            max_line_size=MAX_LINE,
            max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS,
        )
        self._site: web.BaseSite | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen on (host, port), or on `sock`, a socket bound already (a worker's, from its
        supervisor); returns the port (useful with port 0)."""
        await self._runner.setup()
        self._site = tcp_site(self._runner, host, port) if sock is None else web.SockSite(self._runner, sock)
        await self._site.start()
        return self.address[1]

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        assert self._site is not None, "not started"
        host, port = self._runner.addresses[0][:2]
        return str(host), int(port)

    async def stop(self) -> None:
        await self._runner.cleanup()
