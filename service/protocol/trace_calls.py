"""Triton's trace extension on both protocols (gRPC TraceSetting, HTTP /v2/trace/setting and
/v2/models/{name}/trace/setting): read and change the tracing settings while the server runs, in
every worker. The server has one model, so a model's settings are the server's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import InvalidInput
from service.proto import grpc_service_pb2 as pb
from service.tracing import TraceValues

Changes = dict[str, list[str] | None]  # None: back to the value at start (Triton: the global value)


def from_proto(settings: Mapping[str, Any]) -> Changes:
    """A TraceSettingRequest's settings; a setting with no value is reset."""
    return {key: list(value.value) or None for key, value in settings.items()}


def to_proto(settings: TraceValues) -> pb.TraceSettingResponse:
    response = pb.TraceSettingResponse()
    for key, values in settings.items():
        response.settings[key].value.extend(values)
    return response


def from_json(body: Mapping[str, Any]) -> Changes:
    """An HTTP body's settings: a string, a list of strings, or null (reset)."""
    changes: Changes = {}
    for key, value in body.items():
        if value is None:
            changes[key] = None
        elif isinstance(value, str):
            changes[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            changes[key] = value
        else:
            raise InvalidInput(f"trace setting {key[:64]!r}: expected a string, a list of strings or null")
    return changes


def to_json(settings: TraceValues) -> dict[str, str | list[str]]:
    """As Triton's HTTP answers: trace_level a list, the others a string."""
    return {key: values if key == "trace_level" else values[0] for key, values in settings.items()}


def request(changes: Changes) -> pb.TraceSettingRequest:
    """The TraceSettingRequest that makes `changes` in another worker."""
    message = pb.TraceSettingRequest()
    for key, values in changes.items():
        message.settings[key].value.extend(values or [])
    return message
