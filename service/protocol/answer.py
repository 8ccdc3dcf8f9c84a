"""One ModelInfer request answered, the same for gRPC and HTTP: decode (from the message or from
shared memory), compute (stateless through the batcher, or a decode step of a live sequence),
encode (into the reply or into shared memory)."""

from __future__ import annotations

from service.engine.core import InferenceCore
from service.proto import grpc_service_pb2 as pb
from service.protocol.codec import decode_infer_request, encode_infer_response, output_placement, sequence_control
from service.protocol.shm import SystemRegions


async def answer_infer(
    core: InferenceCore, regions: SystemRegions, request: pb.ModelInferRequest, deadline: float | None
) -> pb.ModelInferResponse:
    """`deadline` is on the core's clock (None: none)."""
    model = core.loaded.model
    x = decode_infer_request(request, model, regions)
    target = output_placement(request, x.shape, regions)
    control = sequence_control(request)
    if control is None:
        y, timing = await core.infer(x, deadline)
    else:
        y, timing = await core.step(control, x)
    return encode_infer_response(y, model, request.id, timing.backend, target, regions)
