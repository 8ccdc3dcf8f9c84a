"""Bearer-token authentication as a server interceptor; health and reflection stay open."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from service.errors import ServiceError, Unauthenticated

log = logging.getLogger(__name__)

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

Refuse = Callable[[str, grpc.aio.ServicerContext, ServiceError], Awaitable[None]]  # (method, context, error)
GRPC_HOW = "metadata 'authorization: Bearer <token>'"
HTTP_HOW = "the header 'Authorization: Bearer <token>'"


def read_token(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty; expected the bearer token clients must send")
    return token


class BearerToken:
    """The one check of a client's credentials, for both protocols: `Bearer <token>`, compared in
    constant time; each protocol says in its own words how to send it."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def accepts(self, given: str | bytes | None) -> bool:
        if given is None:
            return False
        return hmac.compare_digest(given.encode() if isinstance(given, str) else bytes(given), self._expected)

    def check(self, given: str | bytes | None, how: str) -> None:
        if not self.accepts(given):
            raise self.refusal(how)

    @staticmethod
    def refusal(how: str) -> Unauthenticated:
        return Unauthenticated(f"missing or wrong credentials: send {how}")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata; compares in constant time.

    A refused call is answered by `refuse`, the same call scope every RPC goes through, so it is
    logged and counted like any other.
    """

    def __init__(self, token: BearerToken, refuse: Refuse) -> None:
        self._token, self._refuse = token, refuse

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(OPEN_SERVICES) or self._authorized(details):
            return await continuation(details)
        handler = await continuation(details)
        name = method.rsplit("/", 1)[-1] if handler is not None else "unknown"  # metric labels: a fixed set
        return self._refusal(name, handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                return self._token.accepts(value)
        return False

    def _refusal(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
        """A handler of the same kind as the real one, answering UNAUTHENTICATED."""

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await self._refuse(method, context, BearerToken.refusal(GRPC_HOW))

        if handler is None:
            return grpc.unary_unary_rpc_method_handler(deny)
        deserializer, serializer = handler.request_deserializer, handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny, deserializer, serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny, deserializer, serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny, deserializer, serializer)
        return grpc.unary_unary_rpc_method_handler(deny, deserializer, serializer)
