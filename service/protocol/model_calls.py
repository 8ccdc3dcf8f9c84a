"""The model-scoped calls both protocols answer alike: readiness, metadata, config and statistics
of a (name, version), the repository index, and the load and unload calls (Triton's repository
extension). gRPC's servicer and the HTTP app render what these return."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from google.protobuf.message import Message

from service.engine.core import InferenceCore
from service.engine.versions import Loaded, VersionState
from service.errors import FeatureOff, ModelNotFound, quote
from service.proto import grpc_service_pb2 as pb
from service.protocol import render
from service.protocol.peers import LOAD, UNLOAD, WorkerPeers


def resolve(core: InferenceCore, name: str, version: str) -> tuple[str, Loaded]:
    """The entry `name` names and the version serving it: the one named, or the latest."""
    return core.identity.check(name), core.versions.for_request(version)


def server_metadata(core: InferenceCore) -> pb.ServerMetadataResponse:
    s = core.settings
    return render.server_metadata(s.http_port is not None, s.shared_memory == "system")


def model_ready(core: InferenceCore, name: str, version: str) -> bool:
    """Ready: the server serves, and the version named (or any) takes requests; a model or version
    that is not loaded is not ready (Triton answers so, not NOT_FOUND)."""
    if name not in core.identity.names:
        return False
    if not version:
        return core.serving_ok()
    loaded = core.versions.get(version)
    return core.serving_ok() and loaded is not None and loaded.state is VersionState.SERVING


def metadata(core: InferenceCore, name: str, version: str) -> pb.ModelMetadataResponse:
    entry, loaded = resolve(core, name, version)
    return render.model_metadata(loaded.model, entry, [v.version for v in core.versions.serving()])


def config(core: InferenceCore, name: str, version: str) -> pb.ModelConfig:
    entry, loaded = resolve(core, name, version)
    return render.model_config(loaded.model, core.serving(loaded), entry, core.loader.policy)


def statistics(core: InferenceCore, name: str, version: str) -> list[pb.ModelStatistics]:
    """The statistics of one entry (`name`), or of every entry (empty), in the version named or
    in every version loaded, as Triton lists them."""
    identity = core.identity
    names = [identity.check(name)] if name else list(identity.names)
    versions = [core.versions.for_request(version).version] if version else [v.version for v in core.versions]
    stats = []
    for entry in names:
        for number in versions or [""]:
            with core.publish.statistics(number, steps=identity.is_sequence_model(entry)) as held:
                stats.append(render.model_statistics(entry, number, held))
    return stats


def index(core: InferenceCore, ready_only: bool) -> pb.RepositoryIndexResponse:
    versions = [(loaded.version, loaded.state.value) for loaded in core.versions]
    return render.repository_index(core.identity, versions, core.readiness(), ready_only)


def _controlled(core: InferenceCore, name: str) -> None:
    """Load and unload calls: only in explicit mode, and only for this server's model."""
    mode = core.settings.model_control_mode
    if mode == "none":
        raise FeatureOff(render.MODEL_CONTROL_OFF)
    if mode == "poll":
        raise FeatureOff(render.MODEL_CONTROL_POLLED)
    if name not in core.identity.names:
        raise ModelNotFound(f"unknown model {quote(name)}; this server serves {core.identity.name!r}")


async def load(core: InferenceCore, name: str, peers: WorkerPeers | None = None) -> None:
    """Load what the repository names now for the model, here and in every other worker (`peers`):
    new versions load beside the ones serving; versions it no longer names retire (their
    sequences finish on them)."""
    _controlled(core, name)
    request = pb.RepositoryModelLoadRequest(model_name=name)
    await _everywhere(core.keeper.load_call(), peers, LOAD, request)


async def unload(core: InferenceCore, name: str, peers: WorkerPeers | None = None) -> None:
    _controlled(core, name)
    request = pb.RepositoryModelUnloadRequest(model_name=name)
    await _everywhere(core.keeper.unload_call(), peers, UNLOAD, request)


async def _everywhere(here: Awaitable[None], peers: WorkerPeers | None, kind: int, request: Message) -> None:
    """A repository call in this worker and, at the same time, in every other one (each reads the
    same repository): every worker acts, and the first refusal is the answer."""
    others = [] if peers is None else [peers.call(w, kind, request, timeout=None) for w in peers.others]
    results = await asyncio.gather(here, *others, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
