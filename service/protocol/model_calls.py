"""The model-scoped reads both protocols answer alike: readiness, metadata, config and statistics
of a (name, version), and the repository index. gRPC's servicer and the HTTP app render what
these return; load and unload are answers (answer.py)."""

from __future__ import annotations

from service.engine.door import Door
from service.proto import grpc_service_pb2 as pb
from service.protocol import render
from service.settings import Settings


def server_metadata(settings: Settings) -> pb.ServerMetadataResponse:
    return render.server_metadata(settings.http_port is not None, settings.shared_memory)


def metadata(door: Door, name: str, version: str) -> pb.ModelMetadataResponse:
    view = door.describe(name, version)
    return render.model_metadata(view.model, view.entry, view.versions)


def config(door: Door, name: str, version: str) -> pb.ModelConfig:
    view = door.describe(name, version)
    return render.model_config(view.model, view.serving, view.entry, view.policy)


def statistics(door: Door, name: str, version: str) -> list[pb.ModelStatistics]:
    """The statistics of one entry (`name`), or of every entry (empty), in the version named or
    in every version loaded, as Triton lists them."""
    return door.statistics(name, version, render.model_statistics)


def index(door: Door, ready_only: bool) -> pb.RepositoryIndexResponse:
    identity, versions, readiness = door.index()
    return render.repository_index(identity, versions, readiness, ready_only)
