"""The routes of `mha verify` that only a client on the server's host can check (inside its pod,
at 127.0.0.1): Triton's system shared memory, each input written to a region of this host,
registered with the server, and its output read back from the same region (docs/api.md, "Shared
memory"); and a sequence's steps each on a new connection, which with several workers reach the
worker that does not hold the sequence and are handed over (through a Service, a new connection
may reach another replica, which does not hold it either)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any, cast

import grpc
import numpy as np

from service.client.client import InferenceError, MHAClient

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
EXTENSION = "system_shared_memory"  # as ServerMetadata names it
CONTROL_REFUSALS = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
Step = Callable[[str, np.ndarray, int, bool, bool], np.ndarray]  # (id, new tokens, offset, start, end) -> their rows


class SharedMemoryRoute:
    """(B, T, C) -> (B, T, C) float32 through a region of its own: the input at its start, the
    output after it; the region unregistered and removed once answered."""

    def __init__(self, client: MHAClient) -> None:
        self.client = client

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype="<f4")
        size = x.nbytes
        region = shared_memory.SharedMemory(create=True, size=2 * size)
        memory = cast(memoryview, region.buf)  # open until close(): typeshed allows None
        try:
            memory[:size] = x.tobytes()
            shape = self._infer(x, region)
            return np.frombuffer(bytes(memory[size : 2 * size]), dtype="<f4").reshape(shape)  # (B, T, C)
        finally:
            region.close()
            region.unlink()

    def _infer(self, x: np.ndarray, region: shared_memory.SharedMemory) -> list[int]:
        name = f"mha-verify-{uuid.uuid4().hex[:12]}"
        self.client.register_region(name, _key(region), region.size)
        try:
            return self.client.infer_in_region(x, name)
        finally:
            with contextlib.suppress(InferenceError):  # the answer's error, not this one, says what went wrong
                self.client.unregister_region(name)


NOT_HERE = "it is for clients on the server's host: run mha verify there, with --url 127.0.0.1:PORT"


def on_this_host(url: str) -> bool:
    """Whether gRPC's HOST:PORT `url` names this host (its loopback)."""
    return url.rsplit(":", 1)[0] in LOOPBACK


def on_new_connections(url: str, like: MHAClient, client_kwargs: dict[str, Any]) -> Step:
    """Each step on a connection of its own (to the model and version `like` addresses), as a client
    that reconnects between steps sends it."""

    def step(sequence_id: str, x: np.ndarray, offset: int, start: bool, end: bool) -> np.ndarray:
        with MHAClient(url, like.model, like.version, own_connection=True, **client_kwargs) as client:
            return client.step(sequence_id, x, offset, start, end).y

    return step


def why_not_checked(client: MHAClient, url: str) -> str | None:
    """Why this client cannot check the shared memory route, or None when it can: the server does
    not offer the extension, is not on this host (as far as `url` says), or registering needs
    another token."""
    if EXTENSION not in client.server_metadata().extensions:
        return "the server does not offer it (`--shared-memory system` turns it on)"
    if not on_this_host(url):
        return NOT_HERE
    probe = shared_memory.SharedMemory(create=True, size=4)
    try:
        name = f"mha-verify-probe-{uuid.uuid4().hex[:12]}"
        client.register_region(name, _key(probe), probe.size)
        client.unregister_region(name)
    except InferenceError as exc:  # any other refusal is the route's to report, as its failure
        if exc.code in CONTROL_REFUSALS:
            return f"registering a region is a control call, refused ({exc.code.name}): give the admin token"
        if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # clients' regions fill --max-shared-memory-regions
            return f"no room for a region of its own: {exc}"
    finally:
        probe.close()
        probe.unlink()
    return None


def _key(region: shared_memory.SharedMemory) -> str:
    """The object's name as shm_open takes it, and Triton's registration names it: `/name`."""
    return "/" + region.name.lstrip("/")
