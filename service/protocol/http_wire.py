"""What the HTTP server answers before a request reaches a route: aiohttp's own refusals (a
request line or header too long, a malformed message), an unknown path, a method a path does not
take. Each answers the documented `{"error": "..."}` JSON with a message that says what was wrong
and what is expected, and is logged at INFO on one line: a client's mistake, not a server fault.
A fault of the server (500) keeps its traceback in the log, and answers JSON too.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

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


class _Connection(RequestHandler):
    """One HTTP connection whose aiohttp-level refusals answer JSON, logged without a trace."""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)  # a server fault: logged with its trace
            text = "internal server error; the server's log has the details"
        else:
            reason = getattr(exc, "message", None) or message or type(exc).__name__
            text = f"the request could not be read as HTTP/1.1: {quote(str(reason), 160)}"
            log.info("HTTP %d: %s", status, text)
            if request.writer.output_size > 0:
                raise ConnectionError("a response was already under way: the connection is closed")
        response = web.json_response({"error": text}, status=status)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class JsonErrorsRunner(web.AppRunner):
    """aiohttp's application runner, its connections answering their own refusals as JSON."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _Server(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            **plain._kwargs,
        )
