"""What the HTTP server answers around its routes: an unknown path or a method a path does not
take answers the documented `{"error": "..."}` JSON with a message that says what was wrong and
what is expected; a request aiohttp cannot read (a request line or header too long, a malformed
message) gets aiohttp's own 400. Each is logged at INFO on one line: a client's mistake, not a
server fault. A keep-alive connection past its age is asked to close.
"""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from service.errors import quote

log = logging.getLogger(__name__)

ROUTES = (
    "GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/{version}] "
    "(and /ready, /config, /stats), POST /v2/models/{name}[/versions/{version}]/infer, "
    "/v2/systemsharedmemory/..."
)


@web.middleware
async def route_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown path (404) or a method its path does not take (405), answered as JSON."""
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{quote(request.method, 16)} is not accepted on {quote(request.path)}: use {allowed}"
        return _refused(405, message, {"Allow": allowed})
    except web.HTTPNotFound:
        return _refused(404, f"no route {quote(request.path)}; the routes are {ROUTES}")


def _refused(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    log.info("HTTP %d: %s", status, message)
    return web.json_response({"error": message}, status=status, headers=headers)


class ClientMistakes(logging.Filter):
    """aiohttp answers a request it cannot read (a request line or header too long, a malformed
    message) with its own 400 and logs it at ERROR with a traceback. It is a client's mistake:
    this filter on aiohttp's server logger makes it one INFO line, without the trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 500) < 500:
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg = "HTTP %d: the request could not be read as HTTP/1.1: %s"
            record.args = (exc.code, quote(str(exc.message), 160))
            record.exc_info, record.exc_text = None, None
        return True


CLIENT_MISTAKES = ClientMistakes()


def quiet_client_mistakes() -> None:
    """Install the filter on aiohttp's server logger (once, however many servers start)."""
    logger = logging.getLogger("aiohttp.server")
    if CLIENT_MISTAKES not in logger.filters:
        logger.addFilter(CLIENT_MISTAKES)


class ConnectionAges:
    """--http-max-connection-age-s: an answer on a keep-alive connection past its age says
    `Connection: close`, and the connection closes once it is sent; its client connects again, and
    through a balancer may reach a replica started since. The age is counted from the connection's
    first answer and varied by a tenth either way, as gRPC varies its own, so that clients that
    connected together do not all connect again together."""

    def __init__(self, max_age_s: float, now: Callable[[], float], spread: Callable[[], float] = random.random) -> None:
        self.max_age_s, self.now, self.spread = max_age_s, now, spread
        self._ends: weakref.WeakKeyDictionary[asyncio.BaseTransport, float] = weakref.WeakKeyDictionary()

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """aiohttp's `on_response_prepare`: every answer, before its headers are sent."""
        if (transport := request.transport) is None:
            return
        now = self.now()
        if (end := self._ends.get(transport)) is None:
            end = self._ends[transport] = now + self.max_age_s * (0.9 + 0.2 * self.spread())
        if now >= end:  # the header for the client (aiohttp settles its own before this signal), the close for aiohttp
            response.headers["Connection"] = "close"
            response.force_close()
