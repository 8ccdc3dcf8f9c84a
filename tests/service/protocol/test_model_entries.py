"""Two model entries, one engine, as Triton lays out one scheduler per model: `mha` (stateless,
dynamic batching) and `mha_sequence` (sequence batching). Each config says only what its entry
schedules, so Triton's tools benchmark `mha` statelessly and `mha_sequence` with sequences."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2 as pb
from tests.support import ServerThread, make_settings


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0)) as s:
        yield s


def _http(server: ServerThread, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as response:
        return json.loads(response.read())


def test_each_entry_has_the_one_scheduler_it_uses(server: ServerThread) -> None:
    with MHAClient(server.url) as stateless, MHAClient(server.url, model="mha_sequence") as sequences:
        plain, stepped = stateless.model_config(), sequences.model_config()
        assert (plain.name, stepped.name) == ("mha", "mha_sequence")
        assert plain.HasField("dynamic_batching") and not plain.HasField("sequence_batching")
        assert stepped.HasField("sequence_batching") and not stepped.HasField("dynamic_batching")
        schedulers = (plain.WhichOneof("scheduling_choice"), stepped.WhichOneof("scheduling_choice"))
        assert schedulers == ("dynamic_batching", "sequence_batching")  # as tritonclient reads them
        assert stepped.sequence_batching.oldest.max_candidate_sequences == server.engine.settings.max_sequences
        assert sequences.model_metadata().name == "mha_sequence"
    assert "sequence_batching" not in _http(server, "/v2/models/mha/config")
    assert "dynamic_batching" not in _http(server, "/v2/models/mha_sequence/config")
    assert _http(server, "/v2/models/mha_sequence/ready") == {"name": "mha_sequence", "ready": True}


def test_the_sequence_entry_takes_steps_and_names_the_stateless_one_otherwise(
    server: ServerThread, small_model_dir: Path
) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    x = np.random.default_rng(4).standard_normal((1, 5, 32), dtype=np.float32)
    with MHAClient(server.url, model="mha_sequence") as client:
        with pytest.raises(InferenceError) as info:
            client.infer(x)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "send sequence_id" in str(info.value) and "'mha'" in str(info.value)
        sequence = client.sequence("entries")
        ys = [sequence.send(x[:, :3]), sequence.send(x[:, 3:4]), sequence.send(x[:, 4:], end=True)]
    reference = attention_view(torch.from_numpy(x), weights, config)
    assert relative_error(torch.from_numpy(np.concatenate(ys, axis=1)), reference) < 1e-5
    with MHAClient(server.url) as client:  # the stateless entry still takes steps: clients that always sent them there
        step = client.step("compat", x, 0, start=True, end=True)
    assert relative_error(torch.from_numpy(step.y.copy()), reference) < 1e-5


def test_statistics_name_every_entry_and_an_unknown_model_names_both(server: ServerThread) -> None:
    with MHAClient(server.url) as client, MHAClient(server.url, model="gpt") as unknown:
        response = client.stub.ModelStatistics(pb.ModelStatisticsRequest(), timeout=10)
        assert [s.name for s in response.model_stats] == ["mha", "mha_sequence"]
        with pytest.raises(InferenceError) as info:
            unknown.model_config()
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert "this server serves 'mha' and 'mha_sequence'" in str(info.value)


def test_the_repository_index_lists_both_entries_and_load_is_refused(server: ServerThread) -> None:
    with MHAClient(server.url) as client:
        index = client.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=10)
        assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [
            ("mha", "1", "READY", ""),
            ("mha_sequence", "1", "READY", ""),
        ]
        with pytest.raises(grpc.RpcError) as info:
            client.stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "model control is off" in info.value.details()
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/repository/index", data=b"{}")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read()) == [
            {"name": "mha", "version": "1", "state": "READY", "reason": ""},
            {"name": "mha_sequence", "version": "1", "state": "READY", "reason": ""},
        ]
    unload = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/repository/models/mha/unload", data=b"")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(unload, timeout=10)
    assert refused.value.code == 501 and "model control is off" in json.loads(refused.value.read())["error"]


def test_a_loading_server_indexes_its_entries_unavailable(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, backend="torch")
    with ServerThread(settings, wait_ready=False) as server, MHAClient(server.url) as client:
        index = client.stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
        ready = client.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=10)
    assert {m.state for m in index.models} == {"UNAVAILABLE"} and all(m.reason for m in index.models)
    assert list(ready.models) == []


def _count(server: ServerThread, name: str, labels: dict[str, str] | None = None) -> float:
    return server.registry.get_sample_value(name, labels or {}) or 0.0


def test_the_sequence_entrys_steps_and_refusals_are_in_the_metrics(server: ServerThread) -> None:
    ok, refused = ({"method": "ModelInfer", "code": code} for code in ("OK", "INVALID_ARGUMENT"))
    before = {key: _count(server, "mha_requests_total", labels) for key, labels in (("ok", ok), ("no", refused))}
    steps = {"model": "mha_sequence", "version": "1"}  # the sequence model's tokens, apart from mha's
    tokens, stateless = (
        _count(server, "mha_tokens_total", steps),
        _count(server, "mha_tokens_total", {"model": "mha", "version": "1"}),
    )
    x = np.ones((1, 3, 32), np.float32)
    with MHAClient(server.url, model="mha_sequence") as client:
        sequence = client.sequence("metered")
        sequence.send(x)
        assert _count(server, "mha_sequences_active") == 1
        sequence.send(x[:, :1], end=True)
        with pytest.raises(InferenceError):
            client.infer(x)  # no sequence_id: refused
    assert _count(server, "mha_requests_total", ok) == before["ok"] + 2
    assert _count(server, "mha_requests_total", refused) == before["no"] + 1
    assert _count(server, "mha_tokens_total", steps) == tokens + 4
    assert _count(server, "mha_tokens_total", {"model": "mha", "version": "1"}) == stateless
    assert _count(server, "mha_sequences_active") == 0
