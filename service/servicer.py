"""The Open Inference Protocol servicer: protobuf in, protobuf out, a few lines per RPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TypeVar

import grpc

from service.backends import Backend
from service.codec import check_model, decode_infer_request, encode_infer_response
from service.core import Duration, InferenceCore, LoadedModel, State
from service.errors import NotReady, ServiceError, to_status
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.requestlog import new_request_id, request_id_var

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVER_NAME = "mha-serve"
EXTENSIONS = ["model_configuration", "statistics", "streaming", "health", "reflection"]


def _server_version() -> str:
    try:
        return version("mha-serve")
    except PackageNotFoundError:
        return "0+unknown"


class _Rpc:
    """One call's bookkeeping: request id, timing, the final code, error mapping."""

    def __init__(self, core: InferenceCore, method: str, client_id: str = "", inference: bool = False) -> None:
        self.core, self.method, self.inference = core, method, inference
        self.request_id = new_request_id(client_id)
        self.code = grpc.StatusCode.OK
        self.detail = ""  # the message a failed call answered with
        self.start = time.perf_counter()
        self._token = request_id_var.set(self.request_id)
        if inference:
            core.request_started()

    def fail(self, exc: Exception) -> tuple[grpc.StatusCode, str]:
        """The one place errors become statuses; server faults are logged with their trace."""
        self.code, self.detail = to_status(exc, self.request_id)
        if not isinstance(exc, ServiceError) or self.code is grpc.StatusCode.INTERNAL:
            log.error("%s failed: %s", self.method, exc, exc_info=exc)
        return self.code, self.detail

    def finish(self) -> None:
        if self.inference:
            self.core.request_finished()
        request_id_var.reset(self._token)
        elapsed = time.perf_counter() - self.start
        metrics = self.core.metrics
        metrics.requests.labels(method=self.method, code=self.code.name).inc()
        metrics.request_duration.labels(method=self.method).observe(elapsed)
        if self.inference:
            self.core.record_outcome(self.code is grpc.StatusCode.OK, elapsed)
        level = logging.DEBUG if self.code is grpc.StatusCode.OK else logging.WARNING
        if self.inference or self.code is not grpc.StatusCode.OK:
            log.log(
                level,
                "%s %s %s",
                self.method,
                self.code.name,
                self.detail,
                extra={"method": self.method, "code": self.code.name, "duration_ms": round(elapsed * 1e3, 3)},
            )


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: InferenceCore) -> None:
        self.core = core

    async def _handle(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        body: Callable[[], Awaitable[T]],
        client_id: str = "",
        inference: bool = False,
    ) -> T:
        """Run one RPC's body: request id, metrics, logs; errors become an aborted status."""
        rpc = _Rpc(self.core, method, client_id, inference)
        try:
            return await body()
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            rpc.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code, message = rpc.fail(exc)
        finally:
            rpc.finish()
        await context.abort(code, message)
        raise AssertionError("context.abort returned")

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        async def body() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)

        return await self._handle(context, "ServerLive", body)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        async def body() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=self.core.state is State.READY)

        return await self._handle(context, "ServerReady", body)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        async def body() -> pb.ModelReadyResponse:
            check_model(self._served(), request.name, request.version)
            return pb.ModelReadyResponse(ready=self.core.state is State.READY)

        return await self._handle(context, "ModelReady", body)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        async def body() -> pb.ServerMetadataResponse:
            extensions = list(EXTENSIONS)
            if self.core.model is not None:
                active = self.core.model.chain.active
                extensions.append(f"backend:{active.name}@{active.device}")
            return pb.ServerMetadataResponse(name=SERVER_NAME, version=_server_version(), extensions=extensions)

        return await self._handle(context, "ServerMetadata", body)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        async def body() -> pb.ModelMetadataResponse:
            check_model(self._served(), request.name, request.version)
            spec = self.core.spec
            shape = [-1, -1, spec.d_model]
            return pb.ModelMetadataResponse(
                name=spec.name,
                versions=[spec.version],
                platform=self._active().platform,
                inputs=[pb.ModelMetadataResponse.TensorMetadata(name=spec.input_name, datatype="FP32", shape=shape)],
                outputs=[pb.ModelMetadataResponse.TensorMetadata(name=spec.output_name, datatype="FP32", shape=shape)],
            )

        return await self._handle(context, "ModelMetadata", body)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        async def body() -> pb.ModelInferResponse:
            return await self._infer(request, context)

        return await self._handle(context, "ModelInfer", body, request.id, inference=True)

    async def _infer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        spec = self.core.spec
        decoded = decode_infer_request(request, spec)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        y, timing = await self.core.infer(decoded.x, deadline)
        return encode_infer_response(y, spec, request.id, timing.backend)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests of one stream are served concurrently (so they can share batches); each
        response carries its request's id. A failed request answers error_message, and the
        stream goes on."""
        responses: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()

        async def one(request: pb.ModelInferRequest) -> None:
            await responses.put(await self._stream_one(request, context))

        async def read() -> None:
            tasks: set[asyncio.Task[None]] = set()
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks)
            finally:
                await responses.put(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await responses.get()) is not None:
                yield response
        finally:
            reader.cancel()

    async def _stream_one(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStreamInferResponse:
        rpc = _Rpc(self.core, "ModelStreamInfer", request.id, inference=True)
        try:
            response = await self._infer(request, context)
            return pb.ModelStreamInferResponse(infer_response=response)
        except Exception as exc:  # reported in-band; the stream stays open
            code, message = rpc.fail(exc)
            return pb.ModelStreamInferResponse(
                error_message=f"{code.name}: {message}",
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
            )
        finally:
            rpc.finish()

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        async def body() -> pb.ModelConfigResponse:
            check_model(self._served(), request.name, request.version)
            return pb.ModelConfigResponse(config=self._model_config())

        return await self._handle(context, "ModelConfig", body)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        async def body() -> pb.ModelStatisticsResponse:
            if request.name or request.version:
                check_model(self._served(), request.name, request.version)
            return pb.ModelStatisticsResponse(model_stats=[self._statistics()])

        return await self._handle(context, "ModelStatistics", body)

    def _served(self) -> tuple[str, str]:
        """(name, version) of the model: known from the settings, even while loading."""
        return self.core.settings.model_name, self.core.settings.model_version

    def _loaded(self) -> LoadedModel:
        if self.core.model is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.core.model

    def _active(self) -> Backend:
        return self._loaded().chain.active

    def _model_config(self) -> pb.ModelConfig:
        spec, settings = self.core.spec, self.core.settings
        model = self._loaded()
        active = model.chain.active
        config = pb.ModelConfig(
            name=spec.name,
            platform=active.platform,
            backend="onnxruntime" if active.name.startswith("ort") else "pytorch",
            max_batch_size=spec.max_request_rows,
            input=[pb.ModelInput(name=spec.input_name, data_type=pb.TYPE_FP32, dims=[-1, spec.d_model])],
            output=[pb.ModelOutput(name=spec.output_name, data_type=pb.TYPE_FP32, dims=[-1, spec.d_model])],
            instance_group=[
                pb.ModelInstanceGroup(
                    kind=pb.ModelInstanceGroup.KIND_GPU
                    if active.device.startswith("cuda")
                    else pb.ModelInstanceGroup.KIND_CPU,
                    count=1,
                )
            ],
        )
        if settings.max_batch_size > 1:
            config.dynamic_batching.max_queue_delay_microseconds = int(settings.max_queue_delay_ms * 1000)
            config.dynamic_batching.preferred_batch_size.append(settings.max_batch_size)
        params = {
            "backend": active.name,
            "device": active.device,
            "fallbacks": ",".join(b.name for b in model.chain.backends[1:]),
            "selection": model.selection.summary(),
            "d_model": str(model.config.d_model),
            "n_head": str(model.config.n_head),
            "max_seq_len": str(model.config.max_seq_len),
            "causal": str(model.config.causal).lower(),
        }
        for key, value in params.items():
            config.parameters[key].string_value = value
        return config

    def _statistics(self) -> pb.ModelStatistics:
        (name, version), stats = self._served(), self.core.stats

        def d(duration: Duration) -> pb.StatisticDuration:
            return pb.StatisticDuration(count=duration.count, ns=duration.ns)

        return pb.ModelStatistics(
            name=name,
            version=version,
            last_inference=stats.last_inference_ms,
            inference_count=stats.inference_count,
            execution_count=stats.execution_count,
            inference_stats=pb.InferStatistics(
                success=d(stats.success),
                fail=d(stats.fail),
                queue=d(stats.queue),
                compute_infer=d(stats.compute_infer),
            ),
            batch_stats=[
                pb.InferBatchStatistics(batch_size=rows, compute_infer=d(duration))
                for rows, duration in sorted(stats.batches.items())
            ],
        )
