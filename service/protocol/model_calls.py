"""The model-scoped reads both protocols answer alike: readiness, metadata, config and statistics
of a (name, version), and the repository index. gRPC's servicer and the HTTP app render what
these return; load and unload are answers (answer.py)."""

from __future__ import annotations

from collections.abc import Iterable

from service.engine.door import Door
from service.errors import FeatureOff, quote
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


def refuse_load_parameters(names: Iterable[str]) -> None:
    """Triton's load parameters (a config to load with, or the model's files) ask for a load this
    server does not do: refused, never ignored, so that no client believes its files serve."""
    given = sorted(names)
    if given:
        shown = ", ".join(quote(name) for name in given[:4]) + (f" and {len(given) - 4} more" if len(given) > 4 else "")
        raise FeatureOff(
            f"load parameters are not supported (got {shown}): this server loads a version from its files in "
            "--model-repository; put them there and load without parameters"
        )
