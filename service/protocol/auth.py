"""Who may make which call: bearer tokens, checked alike for both protocols (gRPC's through a
server interceptor); health and reflection stay open."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from service.errors import PermissionDenied, ServiceError, Unauthenticated
from service.protocol.watched import WatchedFiles

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

Refuse = Callable[[str, grpc.aio.ServicerContext, ServiceError], Awaitable[None]]  # (method, context, error)
GRPC_HOW = "metadata 'authorization: Bearer <token>'"
HTTP_HOW = "the header 'Authorization: Bearer <token>'"
CONTROL_CALLS = frozenset(  # what changes or shows the server for every client: --admin-token-file's
    {
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "LogSettings",
        "TraceSetting",
        *(f"{kind}SharedMemory{call}" for kind in ("System", "Cuda") for call in ("Status", "Register", "Unregister")),
    }
)


def read_tokens(path: Path) -> tuple[str, ...]:
    """The tokens a file holds, one a line (blank lines aside): several while one is rotated."""
    tokens = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not tokens:
        raise ValueError(f"{path} is empty; expected the bearer token clients must send")
    return tokens


class BearerToken:
    """The tokens a client may send, any one of them: `Bearer <token>`, compared in constant
    time with each; each protocol says in its own words how to send it."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        self._expected = [f"Bearer {token}".encode() for token in tokens]

    def accepts(self, given: str | bytes | None) -> bool:
        if given is None:
            return False
        try:  # a header's bytes that are not UTF-8 come back as they were sent (aiohttp's surrogateescape)
            sent = given.encode("utf-8", "surrogateescape") if isinstance(given, str) else bytes(given)
        except UnicodeEncodeError:
            return False
        return sum(hmac.compare_digest(sent, expected) for expected in self._expected) > 0  # every one compared

    @staticmethod
    def refusal(how: str, which: str = "") -> Unauthenticated:
        return Unauthenticated(f"missing or wrong credentials: send {which}{how}")


class Access:
    """Who may make which call. With --auth-token-file every call needs its token; with
    --admin-token-file the control calls (CONTROL_CALLS) need the admin token, which every other
    call takes too. A control call made with the inference token is PERMISSION_DENIED: the client
    is known, and the call is not its to make."""

    def __init__(self, token: tuple[str, ...] | None = None, admin: tuple[str, ...] | None = None) -> None:
        self.replace(token, admin)
        self.open = token is None and admin is None

    def replace(self, token: tuple[str, ...] | None, admin: tuple[str, ...] | None) -> None:
        self._token = None if token is None else BearerToken(token)
        self._admin = None if admin is None else BearerToken(admin)

    def check(self, method: str, given: str | bytes | None, how: str) -> None:
        admin = self._admin
        if admin is not None and method in CONTROL_CALLS:
            if admin.accepts(given):
                return
            if self._token is not None and self._token.accepts(given):
                raise PermissionDenied(f"{method} changes the server for every client: send the admin token in {how}")
            raise BearerToken.refusal(how, "the admin token in ")
        if self._token is None or self._token.accepts(given) or (admin is not None and admin.accepts(given)):
            return  # the admin token compared only where the inference token is not the one sent
        raise BearerToken.refusal(how)


FLAGS = ("--auth-token-file", "--admin-token-file")


class TokenFiles(WatchedFiles):
    """--auth-token-file and --admin-token-file, and the Access they give, read again whenever
    either file changes, so that a token is added or removed without a restart. A change that
    cannot be read, or that would put a token in both files, leaves the tokens as they were."""

    what, label = "the token files", "tokens"

    def __init__(self, token: Path | None, admin: Path | None) -> None:
        super().__init__(token, admin)
        self.access = Access(*self.read())  # what cannot be read at start is the caller's to refuse

    def read(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        named = zip(FLAGS, self._paths, strict=True)
        token, admin = (None if path is None else _read(flag, path) for flag, path in named)
        if token is not None and admin is not None and set(token) & set(admin):
            raise ValueError("--admin-token-file holds a --auth-token-file token: any client could make control calls")
        return token, admin

    def take(self) -> None:
        self.access.replace(*self.read())


def _read(flag: str, path: Path) -> tuple[str, ...]:
    try:
        return read_tokens(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: {exc}") from exc


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata as `access` says, for each method.

    A refused call is answered by `refuse`, the same call scope every RPC goes through, so it is
    logged and counted like any other.
    """

    def __init__(self, access: Access, refuse: Refuse) -> None:
        self._access, self._refuse = access, refuse

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(OPEN_SERVICES):
            return await continuation(details)
        handler = await continuation(details)
        name = method.rsplit("/", 1)[-1] if handler is not None else "unknown"  # metric labels: a fixed set
        try:
            self._access.check(name, _authorization(details), GRPC_HOW)
        except ServiceError as refused:
            return self._refusal(name, handler, refused)
        return handler

    def _refusal(
        self, method: str, handler: grpc.RpcMethodHandler | None, refused: ServiceError
    ) -> grpc.RpcMethodHandler:
        """A handler of the same kind as the real one, answering `refused`."""

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await self._refuse(method, context, refused)

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


def _authorization(details: grpc.HandlerCallDetails) -> str | bytes | None:
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            return value  # type: ignore[no-any-return]
    return None
