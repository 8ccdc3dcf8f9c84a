"""One ModelInfer request answered, the same for gRPC and HTTP: decode (from the message or from
shared memory), compute (stateless through the batcher, or a decode step of a live sequence),
encode (into the reply or into shared memory)."""

from __future__ import annotations

from service.engine.core import InferenceCore
from service.proto import grpc_service_pb2 as pb
from service.protocol.codec import (
    SEQUENCE_LENGTH,
    check_sequence_header,
    decode_infer_request,
    encode_infer_response,
    output_placement,
    sequence_control,
)
from service.protocol.peers import WorkerPeers
from service.protocol.shm import SystemRegions


async def answer_infer(
    core: InferenceCore,
    regions: SystemRegions,
    request: pb.ModelInferRequest,
    deadline: float | None,
    sequence_header: str | None = None,
    peers: WorkerPeers | None = None,
) -> pb.ModelInferResponse:
    """`deadline` is on the core's clock (None: none); `sequence_header` is the request's
    mha-sequence-id header, if it carries one; `peers`, the other workers, to which a step of a
    sequence this worker does not own is handed (None: every sequence is this process's)."""
    control = sequence_control(request)
    check_sequence_header(control, sequence_header)
    if control is not None and peers is not None and (owner := peers.owner(control.id)) is not None:
        timeout = None if deadline is None else max(0.0, deadline - core.clock.now())
        return await peers.forward(owner, request, sequence_header, timeout)  # decoded there, not here
    model = core.loaded.model
    x = decode_infer_request(request, model, regions)
    target = output_placement(request, x.shape, regions)
    if control is None:
        y, timing = await core.infer(x, deadline)
        return encode_infer_response(y, model, request.id, timing.backend, target, regions)
    y, timing, length = await core.step(control, x)
    extra: dict[str, int | str] = {SEQUENCE_LENGTH: length, **core.home}  # and where the sequence lives
    return encode_infer_response(y, model, request.id, timing.backend, target, regions, extra)
