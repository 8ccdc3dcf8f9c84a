"""Bearer-token authentication as a server interceptor; health and reflection stay open."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

Rejected = Callable[[str], None]  # called with the short method name of a refused call


def read_token(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty; expected the bearer token clients must send")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata; compares in constant time."""

    def __init__(self, token: str, on_rejected: Rejected | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_rejected = on_rejected

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(OPEN_SERVICES) or self._authorized(details):
            return await continuation(details)
        name = method.rsplit("/", 1)[-1]
        log.warning(
            "refused %s: missing or wrong bearer token", name, extra={"method": name, "code": "UNAUTHENTICATED"}
        )
        if self._on_rejected is not None:
            self._on_rejected(name)
        return _refusal(await continuation(details))

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False


async def _deny(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong credentials: send metadata 'authorization: Bearer <token>'",
    )


async def _deny_stream(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
    await _deny(request_iterator, context)


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as the real one, answering UNAUTHENTICATED."""
    if handler is None:
        return grpc.unary_unary_rpc_method_handler(_deny)
    deserializer, serializer = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny_stream, deserializer, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny_stream, deserializer, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(_deny, deserializer, serializer)
