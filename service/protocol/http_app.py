"""KServe v2 REST (the Open Inference Protocol over HTTP, as Triton serves it, with Triton's
binary-data extension) on the same core, batcher and call scope as gRPC; aiohttp's server,
embedded in the server's event loop.

A JSON (or JSON + binary) request becomes the protobuf request the gRPC path reads, so every
check of the codec applies unchanged; errors answer `{"error": "..."}` with the HTTP status of
their gRPC code.
"""

from __future__ import annotations

import json
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeGuard

import numpy as np
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from service.engine.core import InferenceCore
from service.errors import ClientGone, FeatureOff, InvalidInput, NotReady, TooLarge, quote
from service.proto import grpc_service_pb2 as pb
from service.protocol import render
from service.protocol.answer import answer_infer
from service.protocol.auth import HTTP_HOW, BearerToken
from service.protocol.calls import Call, Calls
from service.protocol.codec import SEQUENCE_HEADER, in_shared_memory, parameter_values
from service.protocol.http_wire import route_errors
from service.protocol.peers import WorkerPeers
from service.protocol.regions import RegionDirectory
from service.protocol.shm import SystemRegions
from service.protocol.status import http_status
from service.settings import Settings

HEADER_LENGTH = "Inference-Header-Content-Length"
CALL_KEY = web.RequestKey("mha.call", Call)  # the call scope of the request, for its handler
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(call: Call) -> web.Response:
    return web.json_response({"error": in_http_words(call.message)}, status=http_status(call.code, call.error))


# The codec checks the protobuf request an HTTP body becomes, and words its messages in gRPC's
# fields; over HTTP they name what the client wrote instead (tests/service/test_http.py checks
# every refusal for gRPC words).
_HTTP_WORDS = (
    (re.compile(r"\b(?:contents\.)?fp32_contents\b"), "data"),
    (re.compile(r"\braw_input_contents\b"), "binary data (binary_data_size)"),
    (re.compile(r"\ban? u?int64_param\b"), "a JSON integer"),
    (re.compile(r"\ba string_param\b"), "a JSON string"),
    (re.compile(r"\ba bool_param\b"), "a JSON boolean (true or false)"),
    (re.compile(r"\bu?int64_param\b"), "a JSON integer"),
    (re.compile(r"\bstring_param\b"), "a JSON string"),
    (re.compile(r"\bbool_param\b"), "a JSON boolean"),
    (re.compile(r"\bdouble_param\b"), "a JSON number"),
    (re.compile(r"\bcontents\.(\w+)"), r"data of another type (\1)"),
)


def in_http_words(message: str) -> str:
    for pattern, words in _HTTP_WORDS:
        message = pattern.sub(words, message)
    return message


INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def proto_json(message: Message) -> dict[str, Any]:
    """A message as Triton's HTTP endpoint writes it: proto field names, zeros included, and
    64-bit integers as JSON numbers (protobuf's JSON mapping would write them as strings)."""
    doc = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message.DESCRIPTOR, doc)


def _numbers(descriptor: Descriptor, doc: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        value = doc.get(field.name)
        if value is None:
            continue
        if field.type in INT64:
            doc[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            inner = field.message_type.fields_by_name["value"].message_type
            for item in value.values() if inner is not None else ():
                _numbers(inner, item)
        elif field.message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _numbers(field.message_type, item)
    return doc


INT64_RANGE = (-(2**63), 2**63 - 1)


def _object(value: object, what: str) -> dict[str, Any]:
    """A JSON object where the protocol wants one (absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _parameter(value: object) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
            raise InvalidInput(f"parameter value {quote(str(value))} does not fit 64 bits")
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    if isinstance(value, str):
        return pb.InferParameter(string_param=value)
    kind = "null" if value is None else type(value).__name__.replace("dict", "object").replace("list", "array")
    raise InvalidInput(f"a parameter's value is a JSON {kind}; expected a string, a number or a boolean")


def _tensor_data(tensor: dict[str, Any], binary: memoryview, offset: int) -> tuple[bytes | None, list[float], int]:
    """(raw bytes, typed values, new offset) of one JSON input tensor."""
    size = _object(tensor.get("parameters"), "an input's parameters").get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidInput(
                f"binary_data_size {quote(str(size))} does not fit the {len(binary) - offset} bytes sent"
            )
        return bytes(binary[offset : offset + size]), [], offset + size
    try:
        values = np.asarray(tensor.get("data", []), dtype=np.float32).ravel()  # nested or flat: row-major
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"input {quote(str(tensor.get('name')))}: data must be numbers ({exc})") from exc
    return None, values.tolist(), offset


def _parse_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidInput(f"{what} is not valid JSON: {str(exc) or type(exc).__name__}") from exc


def _is_int64(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and INT64_RANGE[0] <= value <= INT64_RANGE[1]


def to_infer_request(
    body: bytes, header_length: int | None, name: str, version: str
) -> tuple[pb.ModelInferRequest, bool]:
    """(the protobuf request, whether the client asked for binary outputs)."""
    split = len(body) if header_length is None else header_length
    if not 0 <= split <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} {header_length} is outside the body's {len(body)} bytes")
    doc = _parse_json(body[:split], "the request")
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs", []), list):
        raise InvalidInput("the request must be a JSON object with an 'inputs' list")
    request = pb.ModelInferRequest(model_name=name, model_version=version, id=str(doc.get("id", ""))[:256])
    parameters = dict(_object(doc.get("parameters"), "the request's parameters"))
    binary_out = bool(parameters.pop("binary_data_output", False))
    for key, value in parameters.items():
        request.parameters[str(key)].CopyFrom(_parameter(value))
    binary, offset = memoryview(body)[split:], 0
    for tensor in doc.get("inputs", []):
        if not isinstance(tensor, dict):
            raise InvalidInput("each input must be a JSON object with name, shape, datatype and data")
        raw, values, offset = _tensor_data(tensor, binary, offset)
        shape = tensor.get("shape", [])
        if not isinstance(shape, list) or not all(_is_int64(d) for d in shape):
            raise InvalidInput(
                f"input {quote(str(tensor.get('name')))}: shape must be a list of 64-bit integers, "
                f"got {quote(str(shape))}"
            )
        entry = request.inputs.add(
            name=str(tensor.get("name", "")), datatype=str(tensor.get("datatype", "")), shape=shape
        )
        for key, value in _object(tensor.get("parameters"), "an input's parameters").items():
            if key != "binary_data_size":  # e.g. shared_memory_region: the codec reads it
                entry.parameters[str(key)].CopyFrom(_parameter(value))
        if raw is not None:
            request.raw_input_contents.append(raw)
        elif values:
            entry.contents.fp32_contents.extend(values)
    outputs = doc.get("outputs") or []
    if not isinstance(outputs, list):
        raise InvalidInput("the request's outputs must be a JSON list")
    for output in outputs:
        output = _object(output, "each requested output")
        out = request.outputs.add(name=str(output.get("name", "")))
        out_parameters = dict(_object(output.get("parameters"), "an output's parameters"))
        binary_out = bool(out_parameters.pop("binary_data", binary_out))
        for key, value in out_parameters.items():
            out.parameters[str(key)].CopyFrom(_parameter(value))
    return request, binary_out


def from_infer_response(response: pb.ModelInferResponse, binary: bool) -> web.Response:
    out = response.outputs[0]
    tensor: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
    doc = {
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "parameters": parameter_values(response.parameters),
        "outputs": [tensor],
    }
    if in_shared_memory(out):  # the placement, and no data: binary_data_size 0, which Triton's C++
        tensor["parameters"] = {**parameter_values(out.parameters), "binary_data_size": 0}  # client reads
        return web.json_response(doc)
    raw = response.raw_output_contents[0]
    if not binary:
        tensor["data"] = np.frombuffer(raw, dtype="<f4").tolist()
        return web.json_response(doc)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(doc).encode()
    return web.Response(
        body=head + raw, content_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))}
    )


class HttpApi:
    def __init__(
        self,
        core: InferenceCore,
        calls: Calls,
        token: str | None,
        regions: SystemRegions,
        peers: WorkerPeers | None = None,
    ) -> None:
        self.core, self.calls, self.regions, self.peers = core, calls, regions, peers
        self.directory = RegionDirectory(regions, peers)  # the regions of every worker, kept by one
        self._token = BearerToken(token) if token else None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.core.settings.max_message_mb * 2**20, middlewares=[route_errors])
        model = "/v2/models/{name}"
        versioned = "/v2/models/{name}/versions/{version}"
        app.router.add_get("/v2/health/live", self._live)
        app.router.add_get("/v2/health/ready", self._ready)
        app.router.add_get("/v2", self._guard("ServerMetadata", self._server_metadata))
        for path in (model, versioned):
            app.router.add_get(path, self._guard("ModelMetadata", self._model_metadata))
            app.router.add_get(path + "/ready", self._guard("ModelReady", self._model_ready))
            app.router.add_get(path + "/config", self._guard("ModelConfig", self._model_config))
            app.router.add_get(path + "/stats", self._guard("ModelStatistics", self._model_stats))
            app.router.add_post(path + "/infer", self._guard("ModelInfer", self._infer, inference=True))
        shm, region = "/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"
        for path in (shm, region):
            app.router.add_get(path + "/status", self._guard("SystemSharedMemoryStatus", self._shm_status))
            app.router.add_post(path + "/unregister", self._guard("SystemSharedMemoryUnregister", self._shm_unregister))
        app.router.add_post(region + "/register", self._guard("SystemSharedMemoryRegister", self._shm_register))
        app.router.add_post("/v2/repository/index", self._guard("RepositoryIndex", self._repository_index))
        for verb, method in (("load", "RepositoryModelLoad"), ("unload", "RepositoryModelUnload")):
            app.router.add_post(f"/v2/repository/models/{{model}}/{verb}", self._guard(method, self._model_control))
        return app

    def _guard(self, method: str, handler: Handler, inference: bool = False) -> Handler:
        """The call scope every RPC goes through, with the bearer token checked first, and the
        model the path names (an inference's is checked with the request, by answer_infer)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            async with self.calls.in_band(method, None, inference=inference, headers=request.headers) as call:
                request[CALL_KEY] = call  # the handler's call (an inference marks whether it was a step)
                self._authorize(request)
                if not inference:
                    name = request.match_info.get("name", self.core.identity.name)
                    self.core.identity.check(name, request.match_info.get("version", ""))
                return await handler(request)
            return error_response(call)

        return handle

    def _authorize(self, request: web.Request) -> None:
        if self._token is not None:
            self._token.check(request.headers.get("Authorization"), HTTP_HOW)

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        ready = self.core.serving_ok()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(proto_json(render.server_metadata(self.core.active_backend())))

    async def _model_metadata(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.json_response(proto_json(render.model_metadata(self.core.loaded.model, name)))

    async def _model_ready(self, request: web.Request) -> web.Response:
        if not self.core.serving_ok():
            raise NotReady(self.core.readiness())
        return web.json_response({"name": request.match_info["name"], "ready": True})

    async def _model_config(self, request: web.Request) -> web.Response:
        config = render.model_config(self.core.loaded.model, self.core.serving(), request.match_info["name"])
        return web.json_response(proto_json(config))

    async def _model_stats(self, request: web.Request) -> web.Response:
        name, version = request.match_info["name"], self.core.identity.version
        with self.core.publish.statistics(steps=self.core.identity.is_sequence_model(name)) as held:
            stats = render.model_statistics(name, version, held)
        return web.json_response({"model_stats": [proto_json(stats)]})

    async def _repository_index(self, request: web.Request) -> web.Response:
        doc = _object(_parse_json(await request.read() or b"{}", "the index request"), "the index request")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput('"ready" must be a JSON boolean (true or false)')
        index = render.repository_index(self.core.identity, self.core.readiness(), ready)
        return web.json_response([proto_json(model) for model in index.models])

    async def _model_control(self, request: web.Request) -> web.Response:
        raise FeatureOff(render.MODEL_CONTROL_OFF)

    async def _shm_register(self, request: web.Request) -> web.Response:
        doc = _object(_parse_json(await request.read() or b"{}", "the registration"), "the registration")
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str) or not _is_int64(offset) or not _is_int64(size) or offset < 0:
            raise InvalidInput('expected {"key": "/name", "offset": bytes >= 0, "byte_size": bytes}')
        await self.directory.register(request.match_info["region"], key, offset, size)
        return web.json_response({})

    async def _shm_unregister(self, request: web.Request) -> web.Response:
        await self.directory.unregister(request.match_info.get("region", ""))
        return web.json_response({})

    async def _shm_status(self, request: web.Request) -> web.Response:
        regions = await self.directory.status(request.match_info.get("region", ""))
        return web.json_response([region.described() for region in regions])

    async def _infer(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            limit = self.core.settings.max_message_mb
            raise TooLarge(f"the request body is larger than this server's limit of {limit} MiB") from exc
        except ConnectionError as exc:  # the client left while sending: nobody waits for an answer
            raise ClientGone(f"the client closed the connection before its body was whole ({exc})") from exc
        header = request.headers.get(HEADER_LENGTH)
        if header is not None and not header.isdigit():
            raise InvalidInput(f"{HEADER_LENGTH} must be a byte count, got {header[:32]!r}")
        name, version = request.match_info["name"], request.match_info.get("version", "")
        proto, binary = to_infer_request(body, int(header) if header else None, name, version)
        header = request.headers.get(SEQUENCE_HEADER)
        answer = await answer_infer(self.core, self.regions, proto, None, header, self.peers, request[CALL_KEY])
        return from_infer_response(answer, binary)


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    if settings.tls_client_ca is not None:
        context.load_verify_locations(settings.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
