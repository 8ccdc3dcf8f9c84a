"""What the HTTP server answers before a request reaches a route: an unknown path or a method a
path does not take answers the documented `{"error": "..."}` JSON with a message that says what
was wrong and what is expected; a request aiohttp cannot read (a request line or header too
long, a malformed message) gets aiohttp's own 400. Each is logged at INFO on one line: a
client's mistake, not a server fault.
"""

from __future__ import annotations

import logging
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
