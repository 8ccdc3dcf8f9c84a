"""What the protocol tests share: the raw ModelInfer of a module's `server`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.support import ServerThread

INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def call(server: ServerThread) -> Iterator[grpc.UnaryUnaryMultiCallable]:
    """ModelInfer taking and answering serialized bytes, so that a test can send any bytes."""
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(server.url, options=options) as channel:
        yield channel.unary_unary(INFER)
