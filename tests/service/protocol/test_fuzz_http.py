"""Hostile JSON against every HTTP route that reads a body, on a real server: whatever a client
sends, the answer is a precise client error (4xx, or 501 for what is not offered), never 500, and
the server answers correctly afterwards."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from tests.support import ServerThread, http_raw, make_settings

C = 32
ROUTES = (
    "/v2/models/mha/infer",
    "/v2/models/mha/versions/1/infer",
    "/v2/models/mha_sequence/infer",
    "/v2/logging",
    "/v2/trace/setting",
    "/v2/models/mha/trace/setting",
    "/v2/repository/index",
    "/v2/repository/models/mha/load",
    "/v2/repository/models/mha/unload",
    "/v2/systemsharedmemory/region/fuzz/register",
    "/v2/systemsharedmemory/region/fuzz/unregister",
    "/v2/cudasharedmemory/region/fuzz/register",
)
KEYS = (  # the names the routes read, so that the fuzz reaches past "unknown field" into each check
    *("inputs", "outputs", "parameters", "id", "name", "shape", "datatype", "data", "config"),
    *("key", "offset", "byte_size", "raw_handle", "device_id", "ready"),
    *("log_verbose_level", "log_info", "log_warning", "log_error", "log_file", "log_format"),
    *("trace_rate", "trace_level", "trace_count", "trace_mode", "trace_file", "log_frequency"),
    *("sequence_id", "sequence_start", "sequence_end", "sequence_offset", "priority", "timeout"),
    *("binary_data_size", "binary_data_output", "binary_data"),
    *("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"),
)

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too
    | st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, 10**400])
    | st.floats()  # NaN and infinities: json.dumps writes them, as a careless client's library may
    | st.text(max_size=8)
    | st.sampled_from(["x", "y", "FP32", "mha", "1", "²", "١٢", "-0", "1e3", "TIMESTAMPS", "OFF", "/fuzz"])
)
JSON = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner),
    max_leaves=24,
)


def _tensor(values: Any) -> st.SearchStrategy[dict[str, Any]]:
    shapes = st.lists(st.integers(-1, 3), min_size=0, max_size=4) | st.just([1, 2, C])
    return st.fixed_dictionaries(
        {"name": st.sampled_from(["x", "y", ""]), "shape": shapes, "datatype": st.sampled_from(["FP32", "FP16", ""])},
        optional={"data": values, "parameters": st.dictionaries(st.sampled_from(KEYS), LEAVES, max_size=3)},
    )


INFER_BODIES = st.fixed_dictionaries(
    {"inputs": st.lists(_tensor(JSON) | JSON, max_size=2)},
    optional={
        "outputs": st.lists(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=3) | JSON, max_size=2),
        "parameters": st.dictionaries(st.sampled_from(KEYS), LEAVES, max_size=4) | JSON,
        "id": JSON,
    },
)


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    level = logging.getLogger().level  # the log settings' fuzz changes this process's level
    with ServerThread(make_settings(small_model_dir, http_port=0, backend="torch", shared_memory="system")) as s:
        yield s
    logging.getLogger().setLevel(level)


def _post(server: ServerThread, path: str, body: bytes) -> tuple[int, Any]:
    assert server.http_port
    return http_raw(server.http_port, path, body)


def _still_exact(server: ServerThread, model_dir: Path) -> None:
    x = np.random.default_rng(0).standard_normal((1, 3, C), dtype=np.float32)
    tensor = {"name": "x", "shape": [1, 3, C], "datatype": "FP32", "data": x.ravel().tolist()}
    status, answer = _post(server, "/v2/models/mha/infer", json.dumps({"inputs": [tensor]}).encode())
    assert status == 200, answer
    y = torch.tensor(answer["outputs"][0]["data"], dtype=torch.float64).reshape(1, 3, C)  # (B, T, C)
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    assert relative_error(y, attention_view(torch.from_numpy(x), weights, config)) < 1e-5


def _refused_precisely(status: int, answer: Any) -> None:
    assert status != 500, answer  # a client's mistake is never the server's error
    if status >= 400:
        assert isinstance(answer, dict) and answer.get("error"), answer
        assert len(answer["error"]) < 2000, answer["error"][:300]  # client strings are cut in messages


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=JSON)
def test_any_json_body_on_any_route_is_answered_or_refused_precisely(
    server: ServerThread, route: str, body: object
) -> None:
    _refused_precisely(*_post(server, route, json.dumps(body).encode()))


LOG_KEYS = ("log_verbose_level", "log_info", "log_warning", "log_error", "log_file", "log_format")
TRACE_KEYS = ("trace_rate", "trace_level", "trace_count", "trace_mode", "trace_file", "log_frequency")
SETTINGS_KEYS = {  # route -> the names it reads
    "/v2/logging": LOG_KEYS,
    "/v2/trace/setting": TRACE_KEYS,
    "/v2/models/mha/trace/setting": TRACE_KEYS,
    "/v2/repository/index": ("ready",),
    "/v2/repository/models/mha/load": ("parameters",),
    "/v2/repository/models/mha/unload": ("parameters",),
    "/v2/systemsharedmemory/region/fuzz/register": ("key", "offset", "byte_size"),
    "/v2/systemsharedmemory/region/fuzz/unregister": ("name",),
    "/v2/cudasharedmemory/region/fuzz/register": ("raw_handle", "device_id", "byte_size"),
}
DIGITS = st.text(st.characters(categories=("Nd", "No")), min_size=1, max_size=3)  # superscripts, Arabic-Indic...
VALUES = st.one_of(DIGITS, st.lists(DIGITS, max_size=2), LEAVES, st.lists(LEAVES, max_size=3))


@st.composite
def settings_calls(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(sorted(SETTINGS_KEYS)))
    return route, draw(st.dictionaries(st.sampled_from(SETTINGS_KEYS[route]), VALUES, min_size=1, max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=settings_calls())
def test_settings_and_registrations_are_applied_or_refused_precisely(
    server: ServerThread, call: tuple[str, dict[str, Any]]
) -> None:
    route, body = call
    _refused_precisely(*_post(server, route, json.dumps(body).encode()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=INFER_BODIES, route=st.sampled_from(ROUTES[:3]))
def test_inference_bodies_near_the_protocol_are_answered_or_refused_precisely(
    server: ServerThread, body: dict[str, Any], route: str
) -> None:
    _refused_precisely(*_post(server, route, json.dumps(body).encode()))


def test_the_server_answers_exactly_after_the_fuzz(server: ServerThread, small_model_dir: Path) -> None:
    _still_exact(server, small_model_dir)
