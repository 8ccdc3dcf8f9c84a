"""The servicer's gRPC method handlers, built from the service descriptor, with a request parser
that never raises: bytes that are not a valid request become INVALID_ARGUMENT through the same
call scope as every other call (gRPC's own parser would answer UNKNOWN with a traceback logged).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import DecodeError, Message

from service.errors import InvalidInput
from service.proto import grpc_service_pb2 as pb
from service.protocol.calls import Calls

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
Context: TypeAlias = grpc.aio.ServicerContext


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
