"""The Open Inference Protocol over gRPC: the method handlers, built from the service descriptor,
and the servicer, protobuf in and protobuf out, a few lines per RPC.

Every call goes through one `Calls` scope (request id, metrics, logs, error mapping); the
codec reads requests and `render` writes what the server knows. The handlers' request parser
never raises: bytes that are not a valid request become INVALID_ARGUMENT through the same call
scope as every other call (gRPC's own parser would answer UNKNOWN with a traceback logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError, Message

from service.engine.door import Door
from service.errors import InvalidInput, NotReady
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol import log_calls, model_calls, render, trace_calls
from service.protocol.answer import Answering
from service.protocol.calls import Call, Calls, StreamItemScope
from service.protocol.grpc_codec import request_from_proto, response_to_proto
from service.protocol.grpc_streams import answer_concurrently
from service.protocol.inference import SEQUENCE_HEADER, one_header

log = logging.getLogger(__name__)
Context: TypeAlias = grpc.aio.ServicerContext


def _deadline(context: Context, door: Door) -> float | None:
    """The call's deadline on the door's clock."""
    remaining = context.time_remaining()
    return door.now() + remaining if remaining is not None else None


def _sequence_header(context: Context) -> str | None:
    """The mha-sequence-id metadata, if the call carries it (refused if twice, and not the same)."""
    values = [v for k, v in context.invocation_metadata() or () if k == SEQUENCE_HEADER and isinstance(v, str)]
    return one_header(SEQUENCE_HEADER, values)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, door: Door, answers: Answering, calls: Calls) -> None:
        self.door, self.answers, self.calls = door, answers, calls

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        async with self.calls.unary("ServerLive", context):
            return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        async with self.calls.unary("ServerReady", context):
            return pb.ServerReadyResponse(ready=self.door.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        async with self.calls.unary("ModelReady", context):
            return pb.ModelReadyResponse(ready=self.door.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        async with self.calls.unary("ServerMetadata", context):
            return model_calls.server_metadata(self.door.settings)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        async with self.calls.unary("ModelMetadata", context):
            return model_calls.metadata(self.door, request.name, request.version)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        async with self.calls.unary("ModelConfig", context):
            return pb.ModelConfigResponse(config=model_calls.config(self.door, request.name, request.version))

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        async with self.calls.unary("ModelStatistics", context):
            stats = await self.answers.statistics(request.name, request.version)
            return pb.ModelStatisticsResponse(model_stats=stats)

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        async with self.calls.unary("SystemSharedMemoryRegister", context):
            await self.answers.register(request.name, request.key, request.offset, request.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        async with self.calls.unary("SystemSharedMemoryUnregister", context):
            await self.answers.unregister(request.name)
            return pb.SystemSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        async with self.calls.unary("SystemSharedMemoryStatus", context):
            return render.system_shm_status(await self.answers.status(request.name))

    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        async with self.calls.unary("CudaSharedMemoryRegister", context):
            await self.answers.register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
            return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        async with self.calls.unary("CudaSharedMemoryUnregister", context):
            await self.answers.unregister_cuda(request.name)
            return pb.CudaSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        async with self.calls.unary("CudaSharedMemoryStatus", context):
            return render.cuda_shm_status(await self.answers.cuda_status(request.name))

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        async with self.calls.unary("RepositoryIndex", context):
            return model_calls.index(self.door, request.ready)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        async with self.calls.unary("RepositoryModelLoad", context):
            model_calls.refuse_load_parameters(request.parameters)
            await self.answers.load(request.model_name)
            return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        async with self.calls.unary("RepositoryModelUnload", context):
            await self.answers.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        async with self.calls.unary("LogSettings", context):
            changes = log_calls.from_proto(request.settings)
            return log_calls.to_proto(await self.answers.log_settings(changes))

    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Context) -> pb.TraceSettingResponse:
        async with self.calls.unary("TraceSetting", context):
            if request.model_name:
                self.door.entry(request.model_name)
            changes = trace_calls.from_proto(request.settings)
            return trace_calls.to_proto(await self.answers.trace_settings(changes))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        async with self.calls.unary("ModelInfer", context, request.id, inference=True) as call:
            return await self._infer(request, context, call)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context) -> None:
        """Requests of one stream are served concurrently (so they can share batches); each
        response carries its request's id. A failed request answers error_message, and the
        stream goes on; a message that is not a request, or draining, ends it with a status.
        Answers are written here (not yielded) so that each one's delivery is known: an answer
        that could not be written counts CANCELLED, and a client that left is no server error."""
        async with self.calls.stream("ModelStreamInfer", context):
            answers = self._stream_answers(request_iterator, context)
            async with contextlib.aclosing(answers):  # closed here, not whenever it is collected
                async for response, _ in answers:
                    if not await _written(context, response):
                        return

    def _stream_answers(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncGenerator[tuple[pb.ModelStreamInferResponse, StreamItemScope], None]:
        """The stream's answers as they complete; reading stops while --stream-window requests are
        read and not yet written, and once the server drains."""
        draining = (self.door.draining, NotReady("the server is draining for shutdown; reconnect to another replica"))
        one = partial(self._stream_one, context=context)
        return answer_concurrently(requests, one, draining, _settle_stream_item, self.door.settings.stream_window)

    async def _stream_one(
        self, request: pb.ModelInferRequest, context: Context
    ) -> tuple[pb.ModelStreamInferResponse, StreamItemScope]:
        scope = self.calls.stream_item("ModelStreamInfer", context, request.id)
        async with scope as call:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request, context, call)), scope
        return render.stream_error(request, call.code, call.message), scope

    async def _infer(self, request: pb.ModelInferRequest, context: Context, call: Call) -> pb.ModelInferResponse:
        deadline, header = _deadline(context, self.door), _sequence_header(context)
        answer = await self.answers.infer(request_from_proto(request), deadline, header, call)
        return response_to_proto(answer)


def _settle_stream_item(answered: tuple[pb.ModelStreamInferResponse, StreamItemScope], delivered: bool) -> None:
    answered[1].settle(delivered)


async def _written(context: Context, response: pb.ModelStreamInferResponse) -> bool:
    """Write one answer of a stream; False when it cannot be, because the client has gone."""
    try:
        await context.write(response)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # gRPC's failed batch: the call is over under us
        log.info("a stream answer could not be written (the client has gone): %s", type(exc).__name__)
        return False
    return True


# The method handlers --------------------------------------------------------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


@dataclass(frozen=True)
class Unparsable:
    """What the parser hands on instead of a message it could not read."""

    type_name: str  # e.g. inference.ModelInferRequest
    reason: str

    def error(self) -> InvalidInput:
        return InvalidInput(f"the request is not a valid {self.type_name}: {self.reason[:200]}")


def _parser(message_type: type[Message]) -> Callable[[bytes], Message | Unparsable]:
    def parse(data: bytes) -> Message | Unparsable:
        try:
            return message_type.FromString(data)
        except (DecodeError, UnicodeDecodeError, RecursionError) as exc:
            return Unparsable(message_type.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return parse


def _unary(name: str, behavior: Callable[..., Awaitable[Any]], calls: Calls) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Message | Unparsable, context: Context) -> Any:
        if isinstance(request, Unparsable):
            await calls.refuse(name, context, request.error())
        return await behavior(request, context)

    return handle


async def _messages(requests: AsyncIterator[Message | Unparsable]) -> AsyncIterator[Message]:
    """A stream's requests; the first unparsable one ends the reading with InvalidInput."""
    async for request in requests:
        if isinstance(request, Unparsable):
            raise request.error()
        yield request


def _stream(behavior: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """A bidirectional stream whose behavior writes its answers (context.write)."""

    async def handle(requests: AsyncIterator[Message | Unparsable], context: Context) -> None:
        await behavior(_messages(requests), context)

    return handle


def generic_handler(servicer: object, calls: Calls) -> grpc.GenericRpcHandler:
    """Handlers for every RPC of inference.GRPCInferenceService, served by `servicer`."""
    handlers = {}
    for method in SERVICE.methods:
        behavior = getattr(servicer, method.name)
        parse = _parser(getattr(pb, method.input_type.name))
        serialize = getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(_stream(behavior), parse, serialize)
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(method.name, behavior, calls), parse, serialize
            )
        else:
            raise NotImplementedError(f"{method.name}: only unary and bidirectional streaming RPCs are served")
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
