"""Triton's log settings on both protocols: verbosity read and changed while the server runs;
a setting this server cannot honour is refused with the reason, and nothing changes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from tests.support import ServerThread, http_json, make_settings


@pytest.fixture
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    before = logging.getLogger().level
    with ServerThread(make_settings(small_model_dir, http_port=0, backend="torch")) as running:
        yield running
    logging.getLogger().setLevel(before)


def _grpc(server: ServerThread, **settings: bool | int | str) -> dict[str, bool | int | str]:
    request = pb.LogSettingsRequest()
    for key, value in settings.items():
        kind = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
        setattr(request.settings[key], kind, value)
    with grpc.insecure_channel(server.url) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).LogSettings(request, timeout=10)
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.settings.items()}


def _http(server: ServerThread, body: dict | None = None) -> tuple[int, dict]:
    return http_json(server.http_port, "/v2/logging", body)


def test_verbosity_changes_at_run_time_on_both_protocols(server: ServerThread) -> None:
    logging.getLogger().setLevel(logging.INFO)
    assert _grpc(server) == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    assert _grpc(server, log_verbose_level=1)["log_verbose_level"] == 1
    assert logging.getLogger().level == logging.DEBUG
    status, settings = _http(server, {"log_verbose_level": 0, "log_info": False})
    assert status == 200 and settings["log_info"] is False and settings["log_warning"] is True
    assert logging.getLogger().level == logging.WARNING
    assert _http(server) == (200, settings)  # GET reads them


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"log_file": "/var/log/triton.log"}, "logs to stderr only"),
        ({"log_format": "ISO8601"}, "--log-format"),
        ({"log_colour": True}, "unknown log setting 'log_colour'"),
        ({"log_info": 1}, "log setting log_info must be a boolean (true or false), got an integer"),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused(server: ServerThread, settings: dict, says: str) -> None:
    logging.getLogger().setLevel(logging.INFO)
    with pytest.raises(grpc.RpcError) as info:
        _grpc(server, **settings)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details()
    status, body = _http(server, settings)
    assert status == 400 and says in body["error"]
    assert logging.getLogger().level == logging.INFO  # nothing changed


@pytest.mark.parametrize("level", [-1, 2**32, 10**30])
def test_a_verbose_level_beyond_uint32_is_refused_over_http(server: ServerThread, level: int) -> None:
    """gRPC carries the level as uint32 (to the other workers too): HTTP's JSON may say more."""
    logging.getLogger().setLevel(logging.INFO)
    status, body = _http(server, {"log_verbose_level": level})
    assert (
        status == 400
        and f"log_verbose_level must be 0 to 4294967295 (0: off, 1 or more: verbose), got {level}" in (body["error"])
    )
    assert logging.getLogger().level == logging.INFO  # nothing changed
