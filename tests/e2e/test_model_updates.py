"""New weights without downtime (issue 45): a version loads beside the one serving while clients
keep calling; sequences finish on the version they began on; a tampered version is refused while
the serving one goes on; a retired version's memory goes once its last sequence ends. Real
server (gRPC and HTTP on loopback), real clients, and Triton's own tritonclient for the
repository calls."""

from __future__ import annotations

import gc
import json
import re
import shutil
import subprocess
import threading
import urllib.request
import weakref
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from export.layout import ModelFiles
from export.pipeline import export_model_dir
from model import MHAConfig
from model.checkpoint import init_weights
from model.reference import attention_view, relative_error
from service.client.client import MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request
from service.settings import Settings
from tests.support import ROOT, ManualClock, ServerProcess, ServerThread, http_json, make_settings, until

SMALL = MHAConfig(d_model=32, n_head=4, max_seq_len=64)
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
EXACT = 1e-5  # fp32 against the float64 reference


def _triton(server: ServerThread, protocol: str, action: str, tmp_path: Path) -> dict:
    """tritonclient's load, unload or index against the server, as a Triton user calls them."""
    assert TRITON_PYTHON.exists(), "make install creates .venv-triton with tritonclient"
    url = server.url if protocol == "grpc" else f"127.0.0.1:{server.http_port}"
    out = tmp_path / f"{protocol}-{action}.json"
    script = str(Path(__file__).with_name("triton_repository.py"))
    command = [str(TRITON_PYTHON), script, protocol, url, action, str(out)]
    run = subprocess.run(command, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    return json.loads(out.read_text())


class Stateless:
    """Clients calling without pause: every answer checked against the weights of the version
    that says it served it."""

    def __init__(self, url: str, weights: dict[str, dict], clients: int = 3) -> None:
        self.url, self.weights = url, weights
        self.stop = threading.Event()
        self.versions: Counter[str] = Counter()
        self.failures: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Stateless:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpc.insecure_channel(self.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while not self.stop.is_set():
                x = rng.standard_normal((1, int(rng.integers(1, 12)), SMALL.d_model), dtype=np.float32)
                try:
                    response = stub.ModelInfer(encode_infer_request(x), timeout=30)
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                    continue
                version = response.model_version
                reference = attention_view(torch.from_numpy(x), self.weights[version], SMALL)
                error = relative_error(torch.from_numpy(decode_infer_response(response).copy()), reference)
                if error >= EXACT:
                    self.failures.append(f"version {version} answered with relative error {error:.2e}")
                self.versions[version] += 1


class Sequence:
    """One sequence, a token a step, each output checked against the reference over its prefix."""

    def __init__(self, client: MHAClient, sequence_id: int, weights: dict[str, dict], seed: int) -> None:
        self.client, self.id, self.weights = client, sequence_id, weights
        self.rng = np.random.default_rng(seed)
        self.prefix = np.zeros((1, 0, SMALL.d_model), np.float32)
        self.versions: set[str] = set()

    def step(self, end: bool = False) -> None:
        x = self.rng.standard_normal((1, 1, SMALL.d_model), dtype=np.float32)
        start = self.prefix.shape[1] == 0
        answer = self.client.step(self.id, x, offset=self.prefix.shape[1], start=start, end=end)
        self.prefix = np.concatenate([self.prefix, x], axis=1)  # (1, L, C)
        reference = attention_view(torch.from_numpy(self.prefix), self.weights[answer.version], SMALL)[:, -1:]
        assert relative_error(torch.from_numpy(answer.y.copy()), reference) < EXACT, (self.id, answer.version)
        assert answer.length == self.prefix.shape[1]
        self.versions.add(answer.version)


def _export(repo: Path, version: int) -> dict:
    weights = init_weights(SMALL, seed=100 + version)
    export_model_dir(repo / "mha" / str(version), SMALL, weights)
    return {k: v.clone() for k, v in weights.items()}


def _sample(server: ServerThread, metric: str, **labels: str) -> float:
    return server.registry.get_sample_value(metric, labels) or 0.0


def test_versions_load_beside_serving_and_sequences_finish_where_they_began(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    weights = {"1": _export(repo, 1)}
    settings = replace(
        make_settings(tmp_path),
        model_dir=None,
        model_repository=repo,
        model_control_mode="explicit",
        load_model="mha",
        backend="ort-cpu",
        http_port=0,
    )
    gc.unfreeze()
    with ServerThread(settings) as server, MHAClient(server.url) as client, Stateless(server.url, weights) as load:
        assert gc.get_freeze_count() > 0, "what the load left alive is kept out of later collections"
        first, second = Sequence(client, 1, weights, 1), Sequence(client, 2, weights, 2)
        for _ in range(3):
            first.step()
            second.step()
        one = weakref.ref(server.engine.life.versions.get("1"))

        weights["2"] = _export(repo, 2)
        loaded = _triton(server, "grpc", "load", tmp_path)
        assert loaded["error"] is None, loaded
        assert {(m["version"], m["state"]) for m in loaded["index"]} >= {("1", "RETIRING"), ("2", "READY")}
        assert loaded["ready"] == {"1": False, "2": True, "3": False}
        third = Sequence(client, 3, weights, 3)
        for _ in range(3):  # the old sequences go on on version 1, the new one runs on version 2
            first.step()
            second.step()
            third.step()

        _export(repo, 3)
        weights_file = ModelFiles(repo / "mha" / "3").weights
        tampered = bytearray(weights_file.read_bytes())
        tampered[-1] ^= 0xFF  # a flipped bit in the last weight
        weights_file.write_bytes(bytes(tampered))
        refused = _triton(server, "http", "load", tmp_path)
        assert refused["error"] is not None and "version 3" in refused["error"]["message"], refused
        assert "weights.safetensors" in refused["error"]["message"], refused
        assert refused["ready"] == {"1": False, "2": True, "3": False}
        third.step()  # version 2 serves on

        first.step(end=True)
        assert server.engine.life.versions.get("1") is not None  # the second sequence still holds it
        second.step(end=True)
        third.step(end=True)
        server.call(server.engine.keeper.loader.settled())
        assert server.engine.life.versions.get("1") is None
        assert one() is None, "version 1's model, backends and caches are released"
        with grpc.insecure_channel(server.url) as channel:
            stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest()).model_stats
        by_entry = {(s.name, s.version): s for s in stats}  # the versions loaded now: 2
        assert set(by_entry) == {("mha", "2"), ("mha_sequence", "2")}
        assert by_entry["mha", "2"].inference_count > 0 and by_entry["mha_sequence", "2"].inference_count == 5
    assert load.failures == []
    assert load.versions["1"] > 0 and load.versions["2"] > 0, load.versions
    assert first.versions == second.versions == {"1"} and third.versions == {"2"}
    assert _sample(server, "mha_model_loads_total", result="loaded") == 2
    assert _sample(server, "mha_model_loads_total", result="refused") == 1


def _version_of_answer(url: str) -> str:
    with grpc.insecure_channel(url) as channel:  # a new connection each time: any worker may take it
        x = np.ones((1, 2, SMALL.d_model), np.float32)
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(encode_infer_request(x), timeout=30).model_version


_until = partial(until, timeout_s=120, every_s=0.1)


def test_poll_mode_follows_the_repository_and_skips_a_half_written_version(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _export(repo, 1)
    _export(tmp_path / "staging", 2)
    settings = replace(
        make_settings(tmp_path),
        model_dir=None,
        model_repository=repo,
        model_control_mode="poll",
        repository_poll_secs=0.2,
        backend="ort-cpu",
    )
    with ServerThread(settings) as server:
        assert _version_of_answer(server.url) == "1"
        first = server.engine.loaded.model.labels()
        half = repo / "mha" / "2"
        half.mkdir()
        shutil.copy(tmp_path / "staging" / "mha" / "2" / "model.onnx", half)  # no weights yet: refused
        _until(lambda: _sample(server, "mha_model_loads_total", result="refused") == 1)
        for _ in range(3):  # refused once, not at every poll; version 1 serves on
            assert _version_of_answer(server.url) == "1"
        assert _sample(server, "mha_model_loads_total", result="refused") == 1
        for path in (tmp_path / "staging" / "mha" / "2").iterdir():
            shutil.copy(path, half)
        _until(lambda: [v.version for v in server.engine.life.versions] == ["2"])
        assert _version_of_answer(server.url) == "2"
        assert _sample(server, "mha_model_info", **first) == 0  # unloaded: its memory went with it


def test_a_policy_naming_no_version_there_is_refused_and_the_serving_one_goes_on(tmp_path: Path) -> None:
    """A config.pbtxt whose version_policy chooses none of the versions present (a typo in a
    version number): before, poll mode retired every version and served nothing, and a load call
    answered OK doing the same. Now it is refused, said and counted once while it stays so,
    version 1 serves on, and the load call says why."""
    repo = tmp_path / "repo"
    _export(repo, 1)
    config = repo / "mha" / "config.pbtxt"
    settings = replace(make_settings(tmp_path), model_dir=None, model_repository=repo, backend="torch")
    polled = replace(settings, model_control_mode="poll", repository_poll_secs=1.0)
    clock = ManualClock()  # the poller's: each advance past a period is one poll
    with ServerThread(polled, clock=clock) as server:
        assert _version_of_answer(server.url) == "1"
        config.write_text("version_policy { specific { versions: [7] } }")
        server.call(clock.advance_and_settle(1.1))
        assert _sample(server, "mha_model_loads_total", result="refused") == 1
        for _ in range(3):  # polled again: said and counted once, and version 1 serves on
            server.call(clock.advance_and_settle(1.1))
            assert _version_of_answer(server.url) == "1"
        assert _sample(server, "mha_model_loads_total", result="refused") == 1
    config.unlink()
    explicit = replace(settings, model_control_mode="explicit", load_model="mha")
    with ServerThread(explicit) as server, grpc.insecure_channel(server.url) as channel:
        config.write_text("version_policy { specific { versions: [7] } }")
        load = pb.RepositoryModelLoadRequest(model_name="mha")
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(load, timeout=60)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = refused.value.details()
        assert "holds versions [1], and its version_policy serves versions [7]" in details, details
        assert "Serving on: versions ['1']" in details, details
        assert _version_of_answer(server.url) == "1"


def _versions_scraped(port: int) -> dict[str, set[str]]:
    """Each model version the served /metrics names -> the families that name it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    named: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name != "python_info" and "version" in s.labels:
                named.setdefault(s.labels["version"], set()).add(family.name)
    return named


def test_a_load_call_reaches_every_worker_and_the_old_versions_series_leave(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _export(repo, 1)
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "mha"]
    server = ServerProcess([*args, "--backend", "ort-cpu", "--workers", "2", "--metrics-unloaded-s", "0"])
    server.start(tmp_path / "server.log")
    try:
        _export(repo, 2)
        with grpc.insecure_channel(server.url) as channel:
            pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="mha"), timeout=300
            )
        assert {_version_of_answer(server.url) for _ in range(16)} == {"2"}
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        serving = {
            (s.labels["version"], s.labels["worker"])
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "mha_model_info" and s.value == 1
        }
        assert serving == {("2", "0"), ("2", "1")}, serving
        until(lambda: set(_versions_scraped(server.metrics_port)) == {"2"}, what="version 1's series leave")
        assert {"nv_inference_count", "mha_model_info"} <= _versions_scraped(server.metrics_port)["2"]
        for port in re.findall(r"worker \d+ started \(pid \d+, metrics 127\.0\.0\.1:(\d+)\)", server.log()):
            # each worker's own registry (its watchdog's reads) drops version 1 too, without a word
            until(lambda port=port: set(_versions_scraped(int(port))) == {"2"}, what="a worker forgets version 1")
        assert {_version_of_answer(server.url) for _ in range(16)} == {"2"}
        assert {"nv_inference_count", "mha_model_info"} <= _versions_scraped(server.metrics_port)["2"]
        assert "Removal of labels" not in server.log()
    finally:
        assert server.terminate() == 0


def _explicit(tmp_path: Path, **ports: int | None) -> Settings:
    """A server of a repository holding version 1, loaded and unloaded on request; its series
    forgotten as soon as a read finds it unloaded."""
    repo = tmp_path / "repo"
    _export(repo, 1)
    return replace(
        make_settings(tmp_path, **ports),
        model_dir=None,
        model_repository=repo,
        model_control_mode="explicit",
        backend="torch",
        metrics_unloaded_s=0,
    )


def test_explicit_mode_starts_empty_loads_and_unloads_on_request(tmp_path: Path) -> None:
    settings = _explicit(tmp_path, http_port=0, metrics_port=0)
    with ServerThread(settings) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready  # nothing loaded without --load-model
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest()).models
        assert [(m.name, m.state) for m in index] == [("mha", "UNAVAILABLE"), ("mha_sequence", "UNAVAILABLE")]
        with_files = pb.RepositoryModelLoadRequest(model_name="mha")
        with_files.parameters["file:1/model.onnx"].bytes_param = b"not the repository's model"
        with pytest.raises(grpc.RpcError) as files:  # never loaded from the repository instead
            stub.RepositoryModelLoad(with_files, timeout=10)
        assert files.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "load parameters are not supported (got 'file:1/model.onnx')" in files.value.details()
        status, body = http_json(server.http_port, "/v2/repository/models/mha/load", {"parameters": {"config": "{}"}})
        assert status == 501 and "load parameters are not supported (got 'config')" in body["error"]
        assert not stub.ServerReady(pb.ServerReadyRequest()).ready
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=120)
        assert stub.ModelReady(pb.ModelReadyRequest(name="mha", version="1")).ready
        assert _version_of_answer(server.url) == "1"
        assert "nv_inference_count" in _versions_scraped(server.metrics_port)["1"]
        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mha"), timeout=120)
        assert not stub.ModelReady(pb.ModelReadyRequest(name="mha", version="1")).ready
        assert _versions_scraped(server.metrics_port) == {}  # unloaded: its series left /metrics
        with pytest.raises(grpc.RpcError) as refused:
            _version_of_answer(server.url)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no version of model 'mha' is loaded" in refused.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="gpt"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=120)
        statistics = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mha", version="1")).model_stats
        assert [s.inference_count for s in statistics] == [0]  # loaded again: its books begin anew
        assert _version_of_answer(server.url) == "1"
        statistics = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mha", version="1")).model_stats
        assert [s.inference_count for s in statistics] == [1]


def _versions_held(server: ServerThread) -> set[str]:
    """The versions the server's registry holds series of, whether or not /metrics serves them."""
    return {s.labels["version"] for f in server.registry.collect() for s in f.samples if "version" in s.labels}


@pytest.mark.parametrize("metrics_port", [None, 0], ids=["no-metrics-port", "never-scraped"])
def test_unloaded_versions_are_forgotten_when_nothing_scrapes(tmp_path: Path, metrics_port: int | None) -> None:
    settings = _explicit(tmp_path, metrics_port=metrics_port)  # no scrape ever reads the registry
    with ServerThread(settings) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=120)
        assert _version_of_answer(server.url) == "1"
        assert "1" in _versions_held(server)
        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mha"), timeout=120)
        _until(lambda: "1" not in _versions_held(server), what="version 1's series are forgotten")
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=120)
        statistics = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mha", version="1")).model_stats
        assert [s.inference_count for s in statistics] == [0]  # its statistics went with them


def test_without_model_control_the_load_calls_say_how_to_turn_it_on(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir)) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as off:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=10)
        assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--model-control-mode explicit" in off.value.details()
