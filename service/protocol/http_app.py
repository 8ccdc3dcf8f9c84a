"""KServe v2 REST (the Open Inference Protocol over HTTP, as Triton serves it, with Triton's
binary-data extension) on the same core, batcher and call scope as gRPC; aiohttp's server,
embedded in the server's event loop.

A JSON (or JSON + binary) request becomes the protocol-neutral request the gRPC path's requests
become too (http_codec.py), so every check applies to both, worded for the client's protocol;
errors answer `{"error": "..."}` with the HTTP status of their code.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import zlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from aiohttp import web

from service.budget import Lease
from service.engine.door import Door
from service.errors import ClientGone, ClientTooSlow, InvalidInput, NotReady, TooLarge, UnsupportedEncoding, quote
from service.protocol import model_calls, trace_calls
from service.protocol.answer import Answering
from service.protocol.auth import HTTP_HOW, Access
from service.protocol.calls import REQUEST_ID_HEADER, Call, Calls
from service.protocol.http_codec import (
    HEADER_LENGTH,
    is_int64,
    json_object,
    proto_json,
    request_from_json,
    response_to_http,
)
from service.protocol.http_json import parse_json
from service.protocol.http_wire import ConnectionAges, route_errors
from service.protocol.inference import SEQUENCE_HEADER, one_header
from service.protocol.status import http_status

CALL_KEY = web.RequestKey("mha.call", Call)  # the call scope of the request, for its handler
BODY_LIMIT_MIB = web.AppKey("mha.body_limit_mib", int)  # --max-message-mb: the largest body read
BODY_READ_S = web.AppKey("mha.body_read_s", float)  # --http-read-timeout-s: the longest a body may take
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger(__name__)


RETRY_AFTER_S = 1  # what 429 and 503 answers suggest
JSON_PARSE_FACTOR = 3  # a JSON body's text, its parsed values and their array: docs/benchmarks.md
RESERVE_STEP = 2**20  # a body without Content-Length is held in the in-flight budget a MiB at a time


async def body_of(request: web.Request, reserve: Callable[[int], None] | None = None, held: int = 0) -> bytes:
    """A request's body, decompressed when its Content-Encoding is gzip or deflate (any other is
    refused, 415). `reserve(n)`: n more bytes, beyond the `held` already reserved, are about to be
    kept (the in-flight budget takes them or refuses): a body without Content-Length, or one that
    decompresses, is read as it arrives and held as it grows, never inflated past the limit; one
    of known size is read at once (aiohttp's read: 5 % faster than iterating, docs/benchmarks.md).
    What stops a body being read is the client's: over the limit, not decodable by its
    Content-Encoding, or a client that left before sending all of it."""
    inflater = Inflater.of(request.headers.get("Content-Encoding", ""))
    try:
        async with asyncio.timeout(request.app[BODY_READ_S]):  # a body dripped holds its budget: not for long
            return await _read(request, inflater, reserve, held)
    except TimeoutError:
        raise ClientTooSlow(
            f"the request body did not arrive whole within {request.app[BODY_READ_S]:g} s (--http-read-timeout-s)"
        ) from None


async def _read(
    request: web.Request, inflater: Inflater | None, reserve: Callable[[int], None] | None, held: int
) -> bytes:
    limit, parts, size, sent = request.app[BODY_LIMIT_MIB] * 2**20, [], 0, 0
    try:
        if inflater is None and (reserve is None or held):  # its size known, held
            return await request.read()
        async for chunk in request.content.iter_any():
            sent += len(chunk)  # as sent, too: empty deflate blocks inflate to nothing, without end
            if inflater is not None:
                chunk = inflater.inflate(chunk, limit - size)
            size += len(chunk)
            if size > limit or sent > limit:
                raise _too_large(request)
            if reserve is not None and size > held:
                grant = max(size - held, RESERVE_STEP)  # a lease per MiB, not per chunk
                reserve(grant)
                held += grant
            parts.append(chunk)
        if inflater is not None:
            inflater.end()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _too_large(request) from exc
    except web.RequestPayloadError as exc:
        raise InvalidInput(f"the request body cannot be read: {' '.join(str(exc).split())[:200]}") from exc
    except ConnectionError as exc:  # the client left while sending: nobody waits for an answer
        raise ClientGone(f"the client closed the connection before its body was whole ({exc})") from exc
    return b"".join(parts)


CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # zlib's wbits


class Inflater:
    """A gzip or deflate body inflated chunk by chunk, never more than the room left at a time (a
    few KiB of zeros can inflate to GiBs). aiohttp's own decompression is off (`auto_decompress`):
    it answered an encoding it lacks (br, zstd) in plain text, asking the client to install a
    library, and read one it does not know as plain bytes."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._zlib: Any = None

    @classmethod
    def of(cls, header: str) -> Inflater | None:
        encoding = header.strip().lower()
        if encoding in ("", "identity"):
            return None
        if encoding not in CODINGS:
            raise UnsupportedEncoding(
                f"Content-Encoding {quote(header, 40)} is not one this server reads: send gzip, deflate or none"
            )
        return cls(encoding)

    def inflate(self, chunk: bytes, room: int) -> bytes:
        """What `chunk` inflates to; past `room` bytes, one byte more (the caller refuses the body)."""
        if self._zlib is None:
            wbits = CODINGS[self.encoding]
            if self.encoding == "deflate" and chunk[0] & 0x0F != 8:  # raw deflate, without zlib's header
                wbits = -zlib.MAX_WBITS
            self._zlib = zlib.decompressobj(wbits)
        try:
            return self._zlib.decompress(chunk, room + 1)  # type: ignore[no-any-return]
        except zlib.error as exc:
            raise self._unreadable(str(exc)) from exc

    def end(self) -> None:
        if self._zlib is None or not self._zlib.eof or self._zlib.unused_data:
            raise self._unreadable("it ends before its compressed stream does, or goes on after it")

    def _unreadable(self, why: str) -> InvalidInput:
        return InvalidInput(f"the request body cannot be read as {self.encoding}: {why}")


def _too_large(request: web.Request) -> TooLarge:
    return TooLarge(f"the request body is larger than this server's limit of {request.app[BODY_LIMIT_MIB]} MiB")


def error_response(call: Call) -> web.Response:
    status = http_status(call.code, call.error)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    response = web.json_response({"error": call.message}, status=status, headers=headers)
    if status == 408:  # the rest of its body is not read: the connection cannot serve another request
        response.force_close()
    return response


class HttpApi:
    def __init__(self, door: Door, answers: Answering, calls: Calls, access: Access) -> None:
        self.door, self.answers, self.calls, self._access = door, answers, calls, access

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.door.settings.max_message_mb * 2**20, middlewares=[route_errors])
        app[BODY_LIMIT_MIB] = self.door.settings.max_message_mb
        app[BODY_READ_S] = self.door.settings.http_read_timeout_s
        if (age := self.door.settings.http_max_connection_age_s) > 0:
            app.on_response_prepare.append(ConnectionAges(age, self.door.now).on_prepare)
        model = "/v2/models/{name}"
        versioned = "/v2/models/{name}/versions/{version}"
        app.router.add_get("/v2/health/live", self._live)
        app.router.add_get("/v2/health/ready", self._ready)
        app.router.add_get("/v2", self._guard("ServerMetadata", self._server_metadata))
        app.router.add_get("/v2/models/stats", self._guard("ModelStatistics", self._model_stats))  # every model
        for path in (model, versioned):
            app.router.add_get(path, self._guard("ModelMetadata", self._model_metadata))
            app.router.add_get(path + "/ready", self._guard("ModelReady", self._model_ready))
            app.router.add_get(path + "/config", self._guard("ModelConfig", self._model_config))
            app.router.add_get(path + "/stats", self._guard("ModelStatistics", self._model_stats))
            app.router.add_post(path + "/infer", self._guard("ModelInfer", self._infer, inference=True))
        for calls, shm, (status, unregister, register) in RegionRoutes(self.answers).endpoints():
            region = shm + "/region/{region}"
            for path in (shm, region):
                app.router.add_get(path + "/status", self._guard(calls + "Status", status))
                app.router.add_post(path + "/unregister", self._guard(calls + "Unregister", unregister))
            app.router.add_post(region + "/register", self._guard(calls + "Register", register))
        app.router.add_post("/v2/repository/index", self._guard("RepositoryIndex", self._repository_index))
        for path, method, handler in SETTINGS:  # GET reads, POST changes then reads
            app.router.add_get(path, self._guard(method, partial(handler, self.answers)))
            app.router.add_post(path, self._guard(method, partial(handler, self.answers)))
        control = "/v2/repository/models/{model}"
        app.router.add_post(control + "/load", self._guard("RepositoryModelLoad", self._model_load))
        app.router.add_post(control + "/unload", self._guard("RepositoryModelUnload", self._model_unload))
        return app

    def _guard(self, method: str, handler: Handler, inference: bool = False) -> Handler:
        """The call scope every RPC goes through, with the caller's access checked first, and the
        model the path names (an inference's is checked with the request, by Answers.infer)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            forwarded = request.headers.get(REQUEST_ID_HEADER, "")
            async with self.calls.in_band(method, None, forwarded, inference, headers=request.headers) as call:
                request[CALL_KEY] = call  # the handler's call (an inference marks whether it was a step)
                if not self._access.open:
                    self._access.check(method, request.headers.get("Authorization"), HTTP_HOW)
                if not inference and "name" in request.match_info:
                    self.door.entry(request.match_info["name"])
                return await handler(request)
            return error_response(call)

        return handle

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        ready = self.door.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(proto_json(model_calls.server_metadata(self.door.settings)))

    async def _model_metadata(self, request: web.Request) -> web.Response:
        name, version = _named(request)
        return web.json_response(proto_json(model_calls.metadata(self.door, name, version)))

    async def _model_ready(self, request: web.Request) -> web.Response:
        name, version = _named(request)
        if not self.door.model_ready(name, version):
            reason = self.door.why_not_ready() or f"version {quote(version)} of model {name!r} does not serve"
            raise NotReady(reason)
        return web.json_response({"name": name, "ready": True})

    async def _model_config(self, request: web.Request) -> web.Response:
        return web.json_response(proto_json(model_calls.config(self.door, *_named(request))))

    async def _model_stats(self, request: web.Request) -> web.Response:
        stats = await self.answers.statistics(*_named(request))
        return web.json_response({"model_stats": [proto_json(s) for s in stats]})

    async def _repository_index(self, request: web.Request) -> web.Response:
        doc = json_object(parse_json(await body_of(request) or b"{}", "the index request"), "the index request")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput('"ready" must be a JSON boolean (true or false)')
        index = model_calls.index(self.door, ready)
        return web.json_response([proto_json(model) for model in index.models])

    async def _model_load(self, request: web.Request) -> web.Response:
        doc = json_object(parse_json(await body_of(request) or b"{}", "the load request"), "the load request")
        model_calls.refuse_load_parameters(json_object(doc.get("parameters", {}), "the load request's parameters"))
        await self.answers.load(request.match_info["model"])
        return web.json_response({})

    async def _model_unload(self, request: web.Request) -> web.Response:
        await self.answers.unload(request.match_info["model"])
        return web.json_response({})

    async def _infer(self, request: web.Request) -> web.Response:
        call = request[CALL_KEY]
        parsed = 1 if HEADER_LENGTH in request.headers else JSON_PARSE_FACTOR  # JSON: its text, then its values

        body: Lease | None = None

        def reserve(nbytes: int) -> None:  # one lease for the body, grown as it arrives
            nonlocal body
            if body is not None:
                body.grow(parsed * nbytes, "its body, parsed")
            else:
                body = self.door.hold(parsed * nbytes, "its body, parsed")
                call.leases.append(body)

        held = request.content_length or 0
        if held:  # held from before it is read: a body the budget cannot take is never read
            reserve(held)
        content = await body_of(request, reserve, held)  # and what it sends beyond: chunked, or decompressed
        header = one_header(HEADER_LENGTH, request.headers.getall(HEADER_LENGTH, []))
        if header is not None and not (header.isascii() and header.isdigit() and len(header) <= 19):  # '²', 10**5000
            raise InvalidInput(f"{HEADER_LENGTH} must be a byte count, got {header[:32]!r}")
        name, version = request.match_info["name"], request.match_info.get("version", "")
        inference, binary = request_from_json(content, int(header) if header else None, name, version)
        if inference.id:  # the client's own id (Triton's field), which its lines carry, as over gRPC
            self.calls.named(call, inference.id)
        header = one_header(SEQUENCE_HEADER, request.headers.getall(SEQUENCE_HEADER, []))
        answer = await self.answers.infer(inference, None, header, call)
        response = response_to_http(answer, binary)
        self.calls.computed(call)  # its answer may wait for a slow reader: no batch waits for it
        await written(request, response, self.door.settings.http_write_timeout_s)
        return response


class RegionRoutes:
    """Triton's shared memory endpoints, system and CUDA, over the answers' region calls."""

    def __init__(self, answers: Answering) -> None:
        self.answers = answers

    def endpoints(self) -> list[tuple[str, str, tuple[Handler, Handler, Handler]]]:
        """(the RPCs' common name, the path, the status, unregister and register handlers) of each kind."""
        return [
            (
                "SystemSharedMemory",
                "/v2/systemsharedmemory",
                (self._system_status, self._system_unregister, self._system_register),
            ),
            (
                "CudaSharedMemory",
                "/v2/cudasharedmemory",
                (self._cuda_status, self._cuda_unregister, self._cuda_register),
            ),
        ]

    async def _system_register(self, request: web.Request) -> web.Response:
        doc = await _body(request, "the registration")
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str) or not is_int64(offset) or not is_int64(size) or offset < 0:
            raise InvalidInput('expected {"key": "/name", "offset": bytes >= 0, "byte_size": bytes}')
        await self.answers.register(request.match_info["region"], key, offset, size)
        return web.json_response({})

    async def _system_unregister(self, request: web.Request) -> web.Response:
        await self.answers.unregister(request.match_info.get("region", ""))
        return web.json_response({})

    async def _system_status(self, request: web.Request) -> web.Response:
        regions = await self.answers.status(request.match_info.get("region", ""))
        return web.json_response([region.described() for region in regions])

    async def _cuda_register(self, request: web.Request) -> web.Response:
        """Triton's body: {"raw_handle": {"b64": the handle's 64 bytes}, "device_id": n, "byte_size": n}."""
        doc = await _body(request, "the registration")
        handle, device, size = doc.get("raw_handle"), doc.get("device_id", 0), doc.get("byte_size")
        encoded = handle.get("b64") if isinstance(handle, dict) else None
        raw = _base64(encoded) if isinstance(encoded, str) else None
        if raw is None or not is_int64(device) or not is_int64(size):
            raise InvalidInput('expected {"raw_handle": {"b64": "<base64>"}, "device_id": n, "byte_size": bytes}')
        await self.answers.register_cuda(request.match_info["region"], raw, device, size)
        return web.json_response({})

    async def _cuda_unregister(self, request: web.Request) -> web.Response:
        await self.answers.unregister_cuda(request.match_info.get("region", ""))
        return web.json_response({})

    async def _cuda_status(self, request: web.Request) -> web.Response:
        regions = await self.answers.cuda_status(request.match_info.get("region", ""))
        described = [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]
        return web.json_response(described)


async def _body(request: web.Request, what: str) -> dict[str, Any]:
    return json_object(parse_json(await body_of(request) or b"{}", what), what)


def _base64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _named(request: web.Request) -> tuple[str, str]:
    """The (model, version) a path names; none: every model (statistics), the latest version."""
    return request.match_info.get("name", ""), request.match_info.get("version", "")


async def written(request: web.Request, response: web.StreamResponse, timeout_s: float) -> None:
    """The answer written before its call closes, so that its bytes stay in the in-flight budget
    until the client has taken them. A client that does not read it within `timeout_s` is cut
    off, as a client that left."""
    try:
        async with asyncio.timeout(timeout_s):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        log.info("an HTTP client did not read its answer within %g s: its connection is closed", timeout_s)
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError from None


async def _settings_body(request: web.Request, what: str) -> dict[str, Any]:
    """A settings call's changes: none for GET, a JSON object of Triton's names for POST."""
    if request.method != "POST":
        return {}
    return json_object(parse_json(await body_of(request) or b"{}", what), what)


async def _log_settings(answers: Answering, request: web.Request) -> web.Response:
    changes = await _settings_body(request, "the log settings")
    return web.json_response(await answers.log_settings(changes))


async def _trace_settings(answers: Answering, request: web.Request) -> web.Response:
    changes = trace_calls.from_json(await _settings_body(request, "the trace settings"))
    return web.json_response(trace_calls.to_json(await answers.trace_settings(changes)))


SETTINGS = (  # Triton's settings extensions: (path, method, handler)
    ("/v2/logging", "LogSettings", _log_settings),
    ("/v2/trace/setting", "TraceSetting", _trace_settings),
    ("/v2/models/{name}/trace/setting", "TraceSetting", _trace_settings),
)
