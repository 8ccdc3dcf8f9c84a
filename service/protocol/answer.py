"""One inference request answered, the same for gRPC and HTTP (both decode into the neutral
InferRequest): decode the input (from the request or from shared memory), compute (stateless
through the batcher, or a decode step of a live sequence), answer (in the reply or into shared
memory)."""

from __future__ import annotations

from service.engine.core import InferenceCore
from service.engine.served import ServedModel
from service.errors import InvalidInput
from service.protocol.calls import Call
from service.protocol.inference import (
    DATATYPE,
    SEQUENCE_LENGTH,
    SHM_KEYS,
    InferRequest,
    InferResponse,
    InputTensor,
    answered,
    check_sequence_header,
    decode_input,
    names_shared_memory,
    output_slice,
    queue_request,
    sequence_control,
)
from service.protocol.peers import WorkerPeers
from service.protocol.shm import SystemRegions


async def answer_infer(
    core: InferenceCore,
    regions: SystemRegions,
    request: InferRequest,
    deadline: float | None,
    sequence_header: str | None = None,
    peers: WorkerPeers | None = None,
    call: Call | None = None,
) -> InferResponse:
    """`deadline` is on the core's clock (None: none); `sequence_header` is the request's
    mha-sequence-id header, if it carries one; `peers`, the other workers (None: there are none).
    With peers, a request naming a shared memory region is answered by the worker that keeps the
    regions, and a step of a sequence this worker does not own by the sequence's owner."""
    entry = core.identity.check(request.model_name)  # the one check of an inference's model
    control = sequence_control(request)
    if call is not None:
        call.step = control is not None  # counted in the sequence model's statistics
    if control is None and core.identity.is_sequence_model(entry):
        raise InvalidInput(
            f"model {entry!r} takes the steps of sequences: send sequence_id (with sequence_start on the first "
            f"step), or send whole sequences to model {core.identity.name!r}"
        )
    check_sequence_header(control, sequence_header)
    queue = queue_request(request)  # the stateless model's priority and queue timeout
    if control is not None:
        deadline = _step_deadline(core, queue, deadline)
    if peers is not None:
        timeout = None if deadline is None else max(0.0, deadline - core.clock.now())
        shared = names_shared_memory(request)
        if shared and (keeper := peers.region_keeper) is not None:
            _check_carried_tensor(request, core.loaded.model)
            return await peers.forward(keeper, request, sequence_header, timeout)
        if control is not None and (owner := peers.owner(control.id)) is not None:
            return await _handed_over(core, regions, request, (peers, owner), sequence_header, timeout, call)
    version = core.route(control, request.model_version)  # the version named, the latest, or the sequence's
    if call is not None:
        call.version = version.version  # counted in its statistics
    model = version.model
    x = decode_input(request, model, regions)
    target = output_slice(request, x.shape, regions)
    _hold(core, call, x.nbytes)
    if control is None:
        y, timing = await core.infer(x, deadline, version, queue, request.id)
        return answered(request, model, y, timing.backend, target, regions)
    y, timing, length = await core.step(control, x, version, deadline)
    extra: dict[str, int | str] = {SEQUENCE_LENGTH: length, **core.location}  # and where the sequence lives
    response = answered(request, model, y, timing.backend, target, regions, extra)
    response.model_name = entry  # the entry the step was sent to: mha or mha_sequence
    return response


def _step_deadline(core: InferenceCore, queue: tuple[int, float | None], deadline: float | None) -> float | None:
    """A step's deadline: the sooner of the call's and the request's `timeout`. The sequence model
    has one priority level."""
    priority, own_timeout = queue
    if priority != 0:
        raise InvalidInput(
            f"priority {priority}: the steps of sequences have one priority level; send 0 or leave it out"
        )
    if own_timeout is None:
        return deadline
    own = core.clock.now() + own_timeout
    return own if deadline is None else min(deadline, own)


def _hold(core: InferenceCore, call: Call | None, input_bytes: int) -> None:
    """The request's input and its answer, in the in-flight budget until its call closes (a
    stream's request: once its answer is written); refused at once when the budget is full."""
    lease = core.budget.take(2 * input_bytes)
    if call is None:  # nobody closes it (a benchmark of this layer alone): nothing to hold
        lease.release()
    else:
        call.leases.append(lease)


def _check_carried_tensor(request: InferRequest, model: ServedModel) -> None:
    """A tensor carried in the request (not in a region) is checked before the request is handed
    over, so that a refusal is worded for the client's protocol (the worker it goes to reads it
    as gRPC)."""
    if not any(key in tensor.parameters for tensor in request.inputs for key in SHM_KEYS):
        decode_input(request, model)


async def _handed_over(
    core: InferenceCore,
    regions: SystemRegions,
    request: InferRequest,
    owner: tuple[WorkerPeers, int],
    sequence_header: str | None,
    timeout: float | None,
    call: Call | None,
) -> InferResponse:
    """A step of a sequence another worker owns. Its tensor is checked here, so that a refusal
    is worded for the client's protocol; when it lives in regions this worker keeps, the owner
    gets the tensor itself, and its output is written here."""
    peers, worker = owner
    model = core.loaded.model
    x = decode_input(request, model, regions)
    target = output_slice(request, x.shape, regions)
    _hold(core, call, x.nbytes)
    if names_shared_memory(request):
        request.inputs[0] = InputTensor(model.input_name, DATATYPE, list(x.shape), raw=x.tobytes())  # (B, T, C)
        request.outputs = []
    response = await peers.forward(worker, request, sequence_header, timeout)
    if target is None:
        return response
    parameters = response.parameters
    backend = str(parameters.pop("backend", ""))
    placed = answered(request, model, response.y, backend, target, regions, parameters)
    placed.model_name = response.model_name
    return placed
