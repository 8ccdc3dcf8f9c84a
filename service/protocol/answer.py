"""One ModelInfer request answered, the same for gRPC and HTTP: decode (from the message or from
shared memory), compute (stateless through the batcher, or a decode step of a live sequence),
encode (into the reply or into shared memory)."""

from __future__ import annotations

from service.engine.core import InferenceCore
from service.errors import InvalidInput
from service.proto import grpc_service_pb2 as pb
from service.protocol.calls import Call
from service.protocol.codec import (
    SEQUENCE_LENGTH,
    check_sequence_header,
    decode_infer_request,
    decode_infer_response,
    encode_infer_request,
    encode_infer_response,
    names_shared_memory,
    output_placement,
    parameter_values,
    request_timeout_s,
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
    call: Call | None = None,
) -> pb.ModelInferResponse:
    """`deadline` is on the core's clock (None: none); `sequence_header` is the request's
    mha-sequence-id header, if it carries one; `peers`, the other workers (None: there are none).
    With peers, a request naming a shared memory region is answered by the worker that keeps the
    regions, and a step of a sequence this worker does not own by the sequence's owner."""
    entry = core.identity.check(request.model_name, request.model_version)  # the one check of an inference's model
    control = sequence_control(request)
    if call is not None:
        call.step = control is not None  # counted in the sequence model's statistics
    if control is None and core.identity.is_sequence_model(entry):
        raise InvalidInput(
            f"model {entry!r} takes the steps of sequences: send sequence_id (with sequence_start on the first "
            f"step), or send whole sequences to model {core.identity.name!r}"
        )
    check_sequence_header(control, sequence_header)
    if (own_timeout := request_timeout_s(request)) is not None:  # the sooner of the call's and the request's
        own = core.clock.now() + own_timeout
        deadline = own if deadline is None else min(deadline, own)
    if peers is not None:
        timeout = None if deadline is None else max(0.0, deadline - core.clock.now())
        shared = names_shared_memory(request)
        if shared and (keeper := peers.region_keeper) is not None:
            return await peers.forward(keeper, request, sequence_header, timeout)
        if control is not None and (owner := peers.owner(control.id)) is not None:
            if shared:  # this worker keeps the regions: the owner gets the tensor itself
                return await _step_with_regions(core, regions, request, (peers, owner), sequence_header, timeout)
            return await peers.forward(owner, request, sequence_header, timeout)  # decoded there, not here
    model = core.loaded.model
    x = decode_infer_request(request, model, regions)
    target = output_placement(request, x.shape, regions)
    if control is None:
        y, timing = await core.infer(x, deadline)
        return encode_infer_response(y, model, request.id, timing.backend, target, regions)
    y, timing, length = await core.step(control, x, deadline)
    extra: dict[str, int | str] = {SEQUENCE_LENGTH: length, **core.placement}  # and where the sequence lives
    response = encode_infer_response(y, model, request.id, timing.backend, target, regions, extra)
    response.model_name = entry  # the entry the step was sent to: mha or mha_sequence
    return response


async def _step_with_regions(
    core: InferenceCore,
    regions: SystemRegions,
    request: pb.ModelInferRequest,
    owner: tuple[WorkerPeers, int],
    sequence_header: str | None,
    timeout: float | None,
) -> pb.ModelInferResponse:
    """A step whose tensors live in regions this worker keeps, of a sequence another worker owns:
    read the input here, hand the owner the step with the tensor in it, write its output here."""
    peers, worker = owner
    model = core.loaded.model
    x = decode_infer_request(request, model, regions)
    target = output_placement(request, x.shape, regions)
    plain = encode_infer_request(x, request.model_name, request.model_version, request.id)
    for key, value in request.parameters.items():
        plain.parameters[key].CopyFrom(value)
    response = await peers.forward(worker, plain, sequence_header, timeout)
    if target is None:
        return response
    answered = parameter_values(response.parameters)  # the owner's sequence_length, replica and worker
    backend = str(answered.pop("backend", ""))
    extra = {key: value for key, value in answered.items() if isinstance(value, int | str)}
    return encode_infer_response(decode_infer_response(response), model, request.id, backend, target, regions, extra)
