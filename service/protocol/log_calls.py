"""Triton's log settings extension on both protocols (gRPC LogSettings, HTTP /v2/logging): read
and change this server's verbosity while it runs, in every worker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import InvalidInput
from service.logs import LogSetting, change_log_settings, log_settings
from service.proto import grpc_service_pb2 as pb

PARAMETER = {bool: "bool_param", int: "uint32_param", str: "string_param"}


def from_proto(settings: Mapping[str, Any]) -> dict[str, LogSetting]:
    """A LogSettingsRequest's settings as plain values."""
    changes: dict[str, LogSetting] = {}
    for key, value in settings.items():
        which = value.WhichOneof("parameter_choice")
        if which is None:
            raise InvalidInput(f"log setting {key[:64]!r} has no value; set bool_param, uint32_param or string_param")
        changes[key] = getattr(value, which)
    return changes


def _filled(message: Any, settings: Mapping[str, LogSetting]) -> Any:
    """`message` (a LogSettingsRequest or Response) with `settings` in its map."""
    for key, value in settings.items():
        setattr(message.settings[key], PARAMETER[type(value)], value)
    return message


def to_proto(settings: Mapping[str, LogSetting]) -> pb.LogSettingsResponse:
    return _filled(pb.LogSettingsResponse(), settings)


def apply(changes: dict[str, LogSetting]) -> dict[str, LogSetting]:
    """The settings after `changes`, here; a mistake is the client's (nothing changes)."""
    if not changes:
        return log_settings()
    try:
        return change_log_settings(changes)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def request(changes: Mapping[str, LogSetting]) -> pb.LogSettingsRequest:
    """The LogSettingsRequest that makes `changes` in another worker."""
    return _filled(pb.LogSettingsRequest(), changes)
