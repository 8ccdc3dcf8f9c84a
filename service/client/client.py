"""A small Python client: numpy arrays in, numpy arrays out."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from export.layout import OUTPUT_NAME
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request
from service.protocol.inference import (
    SEQUENCE_HEADER,
    SEQUENCE_LENGTH,
    SEQUENCE_OFFSET,
    SHM_OFFSET,
    SHM_REGION,
    SHM_SIZE,
)

log = logging.getLogger(__name__)
# gRPC shares one connection among a process's channels to one target; this channel option gives
# a channel a connection of its own, as a separate client process would have.
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


class InferenceError(RuntimeError):
    """The server answered an error; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass(frozen=True)
class StepAnswer:
    y: np.ndarray  # (B, t, C): the outputs of the step's tokens
    length: int  # tokens the server holds for the sequence after the step
    replica: str  # where the sequence lives: the replica's name
    worker: int  # ... and the worker within it
    version: str = ""  # the model version that holds it (the one it began on)


MAX_MESSAGE_MB = 64  # each way, as the server's default --max-message-mb


class MHAClient:
    """Talks the Open Inference Protocol to an mha-serve (or any KServe v2) server."""

    def __init__(
        self,
        url: str,
        model: str = "mha",
        version: str = "",
        token: str | None = None,
        root_certificates: bytes | None = None,
        client_cert: tuple[bytes, bytes] | None = None,  # (key, certificate) for mTLS
        max_message_mb: int = MAX_MESSAGE_MB,
        server_name: str | None = None,
        own_connection: bool = False,
        wait_for_ready: bool = False,
    ) -> None:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_mb * 1024 * 1024),
            ("grpc.max_send_message_length", max_message_mb * 1024 * 1024),
        ]
        self.wait_for_ready = wait_for_ready  # a call waits (within its timeout) for a connection, not failing fast
        if own_connection:
            options.append(OWN_CONNECTION)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if root_certificates is not None:
            key, cert = client_cert if client_cert else (None, None)
            creds = grpc.ssl_channel_credentials(root_certificates, private_key=key, certificate_chain=cert)
            self.channel = grpc.secure_channel(url, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(url, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.model, self.version = model, version
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> MHAClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: object, timeout: float | None, metadata: tuple = ()) -> object:
        try:
            call = getattr(self.stub, method)
            metadata = (*self.metadata, *metadata)
            return call(request, timeout=timeout, metadata=metadata, wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as exc:
            raise InferenceError(exc.code(), exc.details() or "") from exc

    def infer(self, x: np.ndarray, timeout: float | None = 60.0, request_id: str = "") -> np.ndarray:
        """(B, T, C) -> (B, T, C) float32."""
        return self.infer_with_backend(x, timeout, request_id)[0]

    def infer_with_backend(
        self, x: np.ndarray, timeout: float | None = 60.0, request_id: str = ""
    ) -> tuple[np.ndarray, str]:
        """(B, T, C) -> ((B, T, C) float32, the backend that computed it, as the server says)."""
        request = encode_infer_request(x, self.model, self.version, request_id)
        response: pb.ModelInferResponse = self._call("ModelInfer", request, timeout)  # type: ignore[assignment]
        return decode_infer_response(response), response.parameters["backend"].string_param

    def step(
        self,
        sequence_id: int | str,
        x: np.ndarray,
        offset: int,
        start: bool = False,
        end: bool = False,
        timeout: float | None = 60.0,
    ) -> StepAnswer:
        """One step of a sequence: (B, t, C) new tokens -> their (B, t, C) outputs, the tokens the
        server holds after the step and where the sequence lives. `offset` is the number of tokens
        this client believes the server holds before the step: a server whose state differs
        refuses (FAILED_PRECONDITION) instead of answering against it. The id travels as the
        mha-sequence-id header too, which L7 balancers hash on to keep a sequence on one replica."""
        request = encode_infer_request(x, self.model, self.version)
        parameters = request.parameters
        if isinstance(sequence_id, int):
            parameters["sequence_id"].int64_param = sequence_id
        else:
            parameters["sequence_id"].string_param = sequence_id
        parameters["sequence_start"].bool_param = start
        parameters["sequence_end"].bool_param = end
        parameters[SEQUENCE_OFFSET].int64_param = offset
        header = ((SEQUENCE_HEADER, str(sequence_id)),)
        response: pb.ModelInferResponse = self._call("ModelInfer", request, timeout, header)  # type: ignore[assignment]
        params = response.parameters
        length, replica, worker = params[SEQUENCE_LENGTH].int64_param, params["replica"].string_param, params["worker"]
        y = decode_infer_response(response)
        return StepAnswer(y, int(length), replica, int(worker.int64_param), response.model_version)

    def sequence(self, sequence_id: int | str) -> ClientSequence:
        """A sequence to drive step by step; it keeps its offset and restarts with its prefix."""
        return ClientSequence(self, sequence_id)

    def stream_infer(self, xs: Iterable[np.ndarray], timeout: float | None = 120.0) -> Iterator[np.ndarray]:
        """Send many tensors on one stream; yields outputs in request order."""
        requests = [encode_infer_request(x, self.model, self.version, request_id=str(i)) for i, x in enumerate(xs)]
        results: dict[str, np.ndarray] = {}
        try:
            for response in self.stub.ModelStreamInfer(iter(requests), timeout=timeout, metadata=self.metadata):
                if response.error_message:
                    raise InferenceError(grpc.StatusCode.UNKNOWN, response.error_message)
                results[response.infer_response.id] = decode_infer_response(response.infer_response)
        except grpc.RpcError as exc:
            raise InferenceError(exc.code(), exc.details() or "") from exc
        for i in range(len(requests)):
            yield results[str(i)]

    def infer_in_region(self, x: np.ndarray, region: str, timeout: float | None = 60.0) -> list[int]:
        """Triton's system shared memory: (B, T, C) float32 read from `region` at offset 0, where
        the caller wrote `x`, and the output written right after it; returns the output's shape."""
        request = encode_infer_request(x, self.model, self.version)
        del request.raw_input_contents[:]
        size = int(x.size) * 4
        _place(request.inputs[0].parameters, region, size, 0)
        _place(request.outputs.add(name=OUTPUT_NAME).parameters, region, size, size)
        response: pb.ModelInferResponse = self._call("ModelInfer", request, timeout)  # type: ignore[assignment]
        return list(response.outputs[0].shape)

    def register_region(self, name: str, key: str, byte_size: int, timeout: float = 5.0) -> None:
        """Register the system shared memory object `key` (`/name`, as shm_open takes it) as `name`."""
        request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, byte_size=byte_size)
        self._call("SystemSharedMemoryRegister", request, timeout)

    def unregister_region(self, name: str, timeout: float = 5.0) -> None:
        self._call("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name=name), timeout)

    def server_metadata(self, timeout: float = 5.0) -> pb.ServerMetadataResponse:
        return self._call("ServerMetadata", pb.ServerMetadataRequest(), timeout)  # type: ignore[return-value]

    def model_metadata(self, timeout: float = 5.0) -> pb.ModelMetadataResponse:
        request = pb.ModelMetadataRequest(name=self.model, version=self.version)
        return self._call("ModelMetadata", request, timeout)  # type: ignore[return-value]

    def model_config(self, timeout: float = 5.0) -> pb.ModelConfig:
        request = pb.ModelConfigRequest(name=self.model, version=self.version)
        return self._call("ModelConfig", request, timeout).config  # type: ignore[attr-defined]

    def statistics(self, timeout: float = 5.0) -> pb.ModelStatistics:
        request = pb.ModelStatisticsRequest(name=self.model, version=self.version)
        return self._call("ModelStatistics", request, timeout).model_stats[0]  # type: ignore[attr-defined]


def _place(parameters: Any, region: str, byte_size: int, offset: int) -> None:
    """A tensor's place in a registered region, as Triton's parameters say it."""
    parameters[SHM_REGION].string_param = region
    parameters[SHM_SIZE].int64_param = byte_size
    parameters[SHM_OFFSET].int64_param = offset


class ClientSequence:
    """One sequence, as docs/api.md says to drive it: each step carries the offset the client
    believes in; a server that no longer holds the sequence (NOT_FOUND: evicted, restarted, or
    another replica) or holds another state of it (FAILED_PRECONDITION) gets the whole prefix
    again with sequence_start, and the step goes on from there. The prefix is kept client-side."""

    RESTART_ON = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)

    def __init__(self, client: MHAClient, sequence_id: int | str) -> None:
        self.client, self.id = client, sequence_id
        self.tokens: list[np.ndarray] = []  # every (B, t, C) sent, in order: the prefix to restart with
        self.length = 0  # tokens the server holds, as it last said
        self.replica, self.worker = "", 0  # where it lives, as the server last said
        self.restarts = 0

    def send(self, x: np.ndarray, end: bool = False, timeout: float | None = 60.0) -> np.ndarray:
        """(B, t, C) new tokens -> their (B, t, C) outputs."""
        try:
            answer = self.client.step(self.id, x, self.length, self.length == 0, end, timeout)
        except InferenceError as exc:
            if exc.code not in self.RESTART_ON or not self.tokens:
                raise
            self.restarts += 1
            whole = np.concatenate([*self.tokens, x], axis=1)  # (B, P + t, C)
            answer = self.client.step(self.id, whole, 0, True, end, timeout)
        self.tokens.append(x)
        self.length, self.replica, self.worker = answer.length, answer.replica, answer.worker
        return answer.y[:, -x.shape[1] :]  # (B, t, C): the new tokens' rows
