"""Protobuf renderings of what the server knows: metadata, config, statistics, stream errors.

Pure functions next to the codec: no I/O, no gRPC context, no state of their own.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

import grpc

from service.engine.door import Duration, ModelIdentity, ModelStats, ServedModel, Serving, VersionPolicy
from service.proto import grpc_service_pb2 as pb
from service.protocol.cuda_shm import CudaRegion
from service.protocol.inference import DATATYPE
from service.protocol.shm import Region
from service.scheduling import QueuePolicy, SchedulePolicy

SERVER_NAME = "mha-serve"
# Triton's extension names, for what this server implements whatever its flags: the model's config
# and statistics, sequences (sequence_id and the sequence model), request parameters, the repository
# index (load and unload need --model-control-mode explicit), log settings; then those that flags turn on.
EXTENSIONS = (
    "model_configuration",
    "statistics",
    "sequence",
    "parameters",
    "model_repository",
    "schedule_policy",
    "trace",
    "logging",
)


@cache
def server_version() -> str:
    try:
        return version("mha-serve")
    except PackageNotFoundError:
        return "0+unknown"


def server_metadata(http: bool, shared_memory: str) -> pb.ServerMetadataResponse:
    """Name, version and the extensions implemented: `binary_tensor_data` with the HTTP port open,
    `system_shared_memory` and `cuda_shared_memory` as --shared-memory turns them on. (The backend
    serving is in ModelConfig.)"""
    kinds = shared_memory.split(",")
    extensions = [
        *EXTENSIONS,
        *(["binary_tensor_data"] if http else []),
        *(f"{kind}_shared_memory" for kind in ("system", "cuda") if kind in kinds),
    ]
    return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=extensions)


def model_metadata(model: ServedModel, name: str, versions: list[str]) -> pb.ModelMetadataResponse:
    """The entry `name` (the stateless model or the sequence model) as version `model` has it,
    and every version serving."""
    shape = [-1, -1, model.config.d_model]  # (B, T, C)
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=name,
        versions=versions,
        platform=MODEL_PLATFORM,
        inputs=[tensor(name=model.input_name, datatype=DATATYPE, shape=shape)],
        outputs=[tensor(name=model.output_name, datatype=DATATYPE, shape=shape)],
    )


MODEL_PLATFORM = "onnxruntime_onnx"  # stable from one start to the next: the directory's model.onnx
MODEL_BACKEND = "onnxruntime"  # Triton's backend of an onnxruntime_onnx model


def model_config(model: ServedModel, serving: Serving, name: str, policy: VersionPolicy) -> pb.ModelConfig:
    """The entry `name`'s config, with the one scheduler it has, as Triton's schema allows: dynamic
    batching for the stateless model, sequence batching for the sequence model."""
    active, dims = serving.active, [-1, model.config.d_model]  # per row: (T, C)
    groups = pb.ModelInstanceGroup
    kind = groups.KIND_GPU if active.device.startswith("cuda") else groups.KIND_CPU
    config = pb.ModelConfig(
        name=name,
        platform=MODEL_PLATFORM,  # the model's format; what computes it is parameters["backend"]
        backend=MODEL_BACKEND,  # as Triton fills it for an ONNX model (its tools read either)
        max_batch_size=model.max_request_rows,  # as Triton: the largest B a request may carry
        input=[pb.ModelInput(name=model.input_name, data_type=pb.TYPE_FP32, dims=dims)],
        output=[pb.ModelOutput(name=model.output_name, data_type=pb.TYPE_FP32, dims=dims)],
        instance_group=[groups(kind=kind, count=1)],
    )
    _version_policy(config.version_policy, policy)
    sequence_model = model.identity.is_sequence_model(name)
    if not sequence_model:  # its queue: batches formed (unless --max-batch-size 1), priorities, timeouts
        _schedule(config.dynamic_batching, serving.schedule)
        if serving.max_batch_size > 1:
            config.dynamic_batching.max_queue_delay_microseconds = int(serving.max_queue_delay_ms * 1000)
            config.dynamic_batching.preferred_batch_size.append(serving.max_batch_size)
    if serving.max_sequences and model.config.causal and sequence_model:
        sequences = config.sequence_batching
        sequences.max_sequence_idle_microseconds = int(serving.sequence_idle_timeout_s * 1e6)
        sequences.oldest.max_candidate_sequences = serving.max_sequences
        sequences.oldest.preserve_ordering = True  # one sequence's steps run in arrival order
    params = {
        "backend": active.name,
        "backend_platform": active.platform,
        "max_batch_rows": str(serving.max_batch_size),  # --max-batch-size: rows the batcher merges
        "max_queue_delay_ms": f"{serving.max_queue_delay_ms:g}",
        "device": active.device,
        "fallbacks": ",".join(b.name for b in serving.backends if b is not active),
        "selection": serving.selection,
        "precision": model.precision,  # what a client's parity check must tolerate (mha verify --url)
        **{k: v for k, v in model.labels().items() if k not in ("name", "version")},
    }
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def _schedule(out: pb.ModelDynamicBatching, schedule: SchedulePolicy) -> None:
    """Triton's priority fields, as the queue honours them."""
    out.priority_levels = schedule.priority_levels
    out.default_priority_level = schedule.default_priority_level
    _queue_policy(out.default_queue_policy, schedule.default_queue_policy)
    for level, policy in schedule.priority_queue_policy.items():
        _queue_policy(out.priority_queue_policy[level], policy)


def _queue_policy(out: pb.ModelQueuePolicy, policy: QueuePolicy) -> None:
    out.timeout_action = pb.ModelQueuePolicy.TimeoutAction.Value(policy.timeout_action)
    out.default_timeout_microseconds = policy.default_timeout_microseconds
    out.allow_timeout_override = policy.allow_timeout_override
    out.max_queue_size = policy.max_queue_size


def _version_policy(out: pb.ModelVersionPolicy, policy: VersionPolicy) -> None:
    if policy.kind == "all":
        out.all.SetInParent()
    elif policy.kind == "specific":
        out.specific.versions.extend(policy.versions)
    else:
        out.latest.num_versions = policy.count


def _duration(duration: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=duration.count, ns=duration.ns)


def model_statistics(name: str, version: str, stats: ModelStats) -> pb.ModelStatistics:
    return pb.ModelStatistics(
        name=name,
        version=version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(stats.success),
            fail=_duration(stats.fail),
            queue=_duration(stats.queue),
            compute_input=_duration(stats.compute.input),
            compute_infer=_duration(stats.compute.infer),
            compute_output=_duration(stats.compute.output),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=rows,
                compute_input=_duration(p.input),
                compute_infer=_duration(p.infer),
                compute_output=_duration(p.output),
            )
            for rows, p in sorted(stats.batches.items())
        ],
    )


def repository_index(
    identity: ModelIdentity, versions: list[tuple[str, str]], not_ready: str, ready_only: bool
) -> pb.RepositoryIndexResponse:
    """Every model entry in every version loaded (`versions`: (version, state)), READY while the
    version serves and the server is ready (`not_ready`: why not, "" when it is); an entry with
    no version loaded is UNAVAILABLE. `ready_only`: only the ready ones."""
    index = pb.RepositoryIndexResponse.ModelIndex
    models = []
    for name in identity.names:
        if not versions:
            models.append(index(name=name, state="UNAVAILABLE", reason=not_ready or "no version is loaded"))
        for number, state in versions:
            ready = state == "READY" and not not_ready
            reason = "" if ready else (not_ready if state == "READY" else state.lower())
            models.append(index(name=name, version=number, state="READY" if ready else state, reason=reason))
    return pb.RepositoryIndexResponse(models=[m for m in models if m.state == "READY"] if ready_only else models)


def stream_error(request: pb.ModelInferRequest, code: grpc.StatusCode, message: str) -> pb.ModelStreamInferResponse:
    """A failed request inside a stream answers in-band; the stream goes on."""
    return pb.ModelStreamInferResponse(
        error_message=f"{code.name}: {message}",
        infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
    )


def cuda_shm_status(regions: list[CudaRegion]) -> pb.CudaSharedMemoryStatusResponse:
    response = pb.CudaSharedMemoryStatusResponse()
    for region in regions:
        entry = response.regions[region.name]
        entry.name, entry.device_id, entry.byte_size = region.name, region.device_id, region.byte_size
    return response


def system_shm_status(regions: list[Region]) -> pb.SystemSharedMemoryStatusResponse:
    response = pb.SystemSharedMemoryStatusResponse()
    for region in regions:
        entry = response.regions[region.name]
        entry.name, entry.key, entry.offset, entry.byte_size = region.name, region.key, region.offset, region.byte_size
    return response
