"""Scrape the live server after known traffic: families, types, labels, exact counts, promtool."""

from __future__ import annotations

import collections
import hashlib
import json
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.batching import BatchEvent
from service.client.client import InferenceError, MHAClient
from service.metrics import Metrics, UnloadedVersionsLeave, served_registry
from service.protocol.metrics_http import IDLE_S
from tests.support import ROOT, ServerThread, make_settings

PROMTOOL = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool"
SHAPES = [(1, 5), (2, 17), (3, 64), (1, 1), (4, 9)]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def traffic(small_model_dir: Path) -> Iterator[tuple[ServerThread, str]]:
    settings = make_settings(small_model_dir, metrics_port=0, backend="auto")
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        for B, T in SHAPES:
            client.infer(np.ones((B, T, 32), np.float32))
        for bad in (np.ones((1, 2, 31), np.float32), np.ones((1, 65, 32), np.float32)):
            with pytest.raises(InferenceError):
                client.infer(bad)
        with MHAClient(server.url, model="bert") as other, pytest.raises(InferenceError):
            other.infer(np.ones((1, 2, 32), np.float32))
        list(client.stream_infer([np.ones((1, 3, 32), np.float32)] * 2))
        client.model_metadata()
        yield server, scrape(server.metrics_port)


def test_families_and_types(traffic: tuple[ServerThread, str]) -> None:
    _, text = traffic
    types = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("mha_")}
    assert types == {
        "mha_requests": "counter",
        "mha_request_duration_seconds": "histogram",
        "mha_queue_duration_seconds": "histogram",
        "mha_batch_formation_seconds": "histogram",
        "mha_inference_duration_seconds": "histogram",
        "mha_batch_size": "histogram",
        "mha_tokens": "counter",
        "mha_inflight_requests": "gauge",
        "mha_queue_depth": "gauge",
        "mha_inflight_bytes": "gauge",
        "mha_inflight_budget_bytes": "gauge",
        "mha_backend_fallbacks": "counter",
        "mha_backend_info": "gauge",
        "mha_model_info": "gauge",
        "mha_ready": "gauge",
        "mha_sequences_active": "gauge",
        "mha_device_required": "gauge",
        "mha_tls_certificate_expiry_timestamp_seconds": "gauge",
        "mha_watched_files_refused": "gauge",
        "mha_sequence_state_bytes": "gauge",
        "mha_sequences_capacity": "gauge",
        "mha_sequence_state_budget_bytes": "gauge",
        "mha_sequence_evictions": "counter",
        "mha_queue_capacity": "gauge",
        "mha_model_versions": "gauge",
        "mha_model_version_sequences": "gauge",
        "mha_model_loads": "counter",
        "mha_audit_checked": "counter",
        "mha_audit_seconds": "counter",
        "mha_audit_mismatches": "counter",
        "mha_audit_skipped": "counter",
    }
    triton = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("nv_")}
    assert triton == {  # Triton's names, without the `_total` a counter would get: gauges that only grow
        **{
            name: "gauge"
            for name in (
                "nv_inference_request_success",
                "nv_inference_request_failure",
                "nv_inference_count",
                "nv_inference_exec_count",
                "nv_inference_request_duration_us",
                "nv_inference_queue_duration_us",
                "nv_inference_compute_input_duration_us",
                "nv_inference_compute_infer_duration_us",
                "nv_inference_compute_output_duration_us",
            )
        },
        "nv_inference_pending_request_count": "gauge",
    }
    assert "nv_inference_request_success_total" not in text
    assert "_created" not in text
    others = {f.name for f in text_string_to_metric_families(text)}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "python_info"} <= others  # for the dashboard


def test_exact_counts(traffic: tuple[ServerThread, str]) -> None:
    server, text = traffic
    s = samples(text)
    req = lambda method, code: s.get(("mha_requests_total", (("code", code), ("method", method))), 0)  # noqa: E731
    assert req("ModelInfer", "OK") == len(SHAPES)
    assert req("ModelInfer", "INVALID_ARGUMENT") == 2
    assert req("ModelInfer", "NOT_FOUND") == 1
    assert req("ModelStreamInfer", "OK") == 2
    assert req("ModelMetadata", "OK") == 1
    assert s[("mha_tokens_total", (("model", "mha"), ("version", "1")))] == sum(B * T for B, T in SHAPES) + 2 * 3
    assert s[("mha_request_duration_seconds_count", (("method", "ModelInfer"),))] == len(SHAPES) + 3
    assert s[("mha_queue_duration_seconds_count", (("model", "mha"), ("version", "1")))] == len(SHAPES) + 2
    assert s[("mha_inflight_requests", ())] == 0
    assert s[("mha_ready", ())] == 1
    settings = server.settings
    assert s[("mha_sequences_capacity", ())] == settings.max_sequences
    assert s[("mha_sequence_state_budget_bytes", ())] == int(settings.max_sequence_state_mb * 2**20)


def test_tritons_series_count_what_model_statistics_counts(traffic: tuple[ServerThread, str]) -> None:
    """Triton's nv_* series: the same records as ModelStatistics, in Triton's units (counts, µs)."""
    server, text = traffic
    s = samples(text)
    mha = (("model", "mha"), ("version", "1"))
    nv = lambda name, *labels: s.get((name, tuple(sorted(mha + labels))), -1)  # noqa: E731
    close = partial(pytest.approx, abs=0.1)  # µs; the statistics keep whole ns per request
    with server.engine.publish.statistics("1") as stats:
        assert nv("nv_inference_request_success") == stats.success.count == len(SHAPES) + 2  # + the stream's
        assert nv("nv_inference_count") == stats.inference_count == sum(B for B, _ in SHAPES) + 2
        assert nv("nv_inference_exec_count") == stats.execution_count
        assert nv("nv_inference_queue_duration_us") == close(stats.queue.ns / 1e3)
        assert nv("nv_inference_request_duration_us") == pytest.approx(
            stats.success.ns / 1e3, abs=0.01 * len(SHAPES) + 0.1
        )
        assert nv("nv_inference_compute_infer_duration_us") == pytest.approx(
            stats.compute.infer.ns / 1e3, abs=0.01 * len(SHAPES) + 0.1
        )
    assert nv("nv_inference_request_failure", ("reason", "OTHER")) == 3  # two bad shapes, one unknown model
    assert nv("nv_inference_request_failure", ("reason", "REJECTED")) == 0  # there, at zero, for alerts
    assert nv("nv_inference_pending_request_count") == 0


def test_labels_of_backends_model_and_fallbacks(traffic: tuple[ServerThread, str]) -> None:
    server, text = traffic
    s = samples(text)
    chain = server.engine.loaded.chain
    info = {dict(k[1])["backend"]: v for k, v in s.items() if k[0] == "mha_backend_info"}
    assert info == {b.name: (1.0 if b in chain.serving() else 0.0) for b in chain.backends}
    assert chain.backends[0] in chain.serving()
    model = next(dict(k[1]) for k in s if k[0] == "mha_model_info")
    assert model == {
        "name": "mha",
        "version": "1",
        "d_model": "32",
        "n_head": "4",
        "max_seq_len": "64",
        "causal": "true",
        "weights_sha256": hashlib.sha256((server.settings.model_dir / "weights.safetensors").read_bytes()).hexdigest(),
        "verified": "true",
    }
    fallbacks = {tuple(sorted(dict(k[1]).items())): v for k, v in s.items() if k[0] == "mha_backend_fallbacks_total"}
    assert fallbacks == {  # every fallback a batch may take, at zero (light batches may have their own order)
        (("from", order[0].name), ("reason", r), ("to", order[1].name)): 0.0
        for order in chain.orders()
        for r in ("error", "invalid_output")
    }
    backends = {dict(k[1])["backend"] for k in s if k[0] == "mha_inference_duration_seconds_count"}
    assert backends and backends <= {b.name for b in chain.serving()}


def test_scraped_buckets_resolve_100us_to_10s(traffic: tuple[ServerThread, str]) -> None:
    s = samples(traffic[1])
    les = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "mha_queue_duration_seconds_bucket")
    assert les[0] == 0.0001 and les[-2] == 10.0 and les[-1] == float("inf")


def test_promtool_check_metrics(traffic: tuple[ServerThread, str]) -> None:
    """promtool's lint passes, but for Triton's own names (kept as Triton spells them)."""
    run = subprocess.run(
        [str(PROMTOOL), "check", "metrics"], input=traffic[1], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert problems and all(line.startswith("nv_inference_") for line in problems), problems


def test_rejected_requests_are_counted(small_model_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken")
    settings = make_settings(small_model_dir, metrics_port=0, auth_token_file=token, backend="torch")
    with ServerThread(settings) as server:
        with MHAClient(server.url, token="nope") as client, pytest.raises(InferenceError) as info:
            client.infer(np.ones((1, 2, 32), np.float32))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with MHAClient(server.url, token="t0ken") as client:
            client.infer(np.ones((1, 2, 32), np.float32))
        s = samples(scrape(server.metrics_port))
    assert s[("mha_requests_total", (("code", "UNAUTHENTICATED"), ("method", "ModelInfer")))] == 1
    assert s[("mha_requests_total", (("code", "OK"), ("method", "ModelInfer")))] == 1
    assert s[("mha_tokens_total", (("model", "mha"), ("version", "1")))] == 2


def test_made_up_methods_share_one_label(small_model_dir: Path, tmp_path: Path) -> None:
    """Labels come from a fixed set: 30 invented method names must not make 30 series."""
    token = tmp_path / "token"
    token.write_text("t0ken")
    settings = make_settings(small_model_dir, metrics_port=0, auth_token_file=token, backend="torch")
    with ServerThread(settings) as server, grpc.insecure_channel(server.url) as channel:
        for i in range(30):
            with pytest.raises(grpc.RpcError):
                channel.unary_unary(f"/evil.Svc/m{i}")(b"", timeout=5)
        s = samples(scrape(server.metrics_port))
    methods = {dict(k[1])["method"] for k in s if k[0] == "mha_requests_total"}
    assert methods == {"unknown"}
    assert s[("mha_requests_total", (("code", "UNAUTHENTICATED"), ("method", "unknown")))] == 30


def test_the_metrics_port_serves_metrics_only_without_a_thread_per_connection(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, metrics_port=0, metrics_host="127.0.0.1", backend="torch")
    with ServerThread(settings) as server:
        assert server.running is not None and server.running.side.metrics is not None
        assert server.running.side.metrics.address == ("127.0.0.1", server.metrics_port)
        threads = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", server.metrics_port)) for _ in range(200)]
        try:
            assert "mha_requests" in scrape(server.metrics_port)  # served while 200 connections idle
            assert threading.active_count() <= threads + 2
            trickle = idle[0]
            trickle.sendall(b"GET /metr")  # a head that never ends, and connections that send nothing:
            for s in (trickle, idle[1]):  # closed by the server after IDLE_S, not held
                s.settimeout(IDLE_S * 4)
                assert s.recv(100) == b""
        finally:
            for s in idle:
                s.close()
        for path in ("/healthz", "/", "/metrics/../x"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}{path}", timeout=5)
            assert info.value.code == 404


def test_a_worker_that_cannot_write_its_exemplars_says_so_and_its_series_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Exemplars are a convenience: a folder gone (or full) costs a warning, never the refresh
    that writes a worker's series."""
    metrics = Metrics(CollectorRegistry(), worker=None, exemplars=tmp_path / "gone" / "exemplars-0.json")
    metrics.requests.observe_calls([("ModelInfer", "OK", 0.002, "0af7651916cd43dd8448eb211c80319c")])
    metrics.refresh()
    assert any("latency exemplars not written" in r.getMessage() for r in caplog.records)
    written = tmp_path / "exemplars-1.json"
    metrics = Metrics(CollectorRegistry(), worker=None, exemplars=written)
    metrics.requests.observe_calls([("ModelInfer", "OK", 0.002, "0af7651916cd43dd8448eb211c80319c")])
    metrics.refresh()
    ((method, le, trace_id, seconds, when),) = json.loads(written.read_text())  # its bucket's latest
    assert (method, le, trace_id, seconds) == ("ModelInfer", 0.0025, "0af7651916cd43dd8448eb211c80319c", 0.002)
    assert when > 0


def _labels(version: str) -> dict[str, str]:
    model = {"name": "mha", "version": version, "d_model": "32", "n_head": "4", "max_seq_len": "64"}
    return {**model, "causal": "true", "weights_sha256": "0" * 64, "verified": "true"}


def test_an_unloaded_versions_series_leave_metrics_after_the_grace() -> None:
    """Real series of three versions, read through what /metrics serves, on a clock the test
    moves: an unloaded version's series stay for the grace, then leave; loaded again, they come
    back. A version whose mha_model_info left with a dead worker's files goes too."""
    now = [0.0]
    metrics = Metrics(CollectorRegistry(auto_describe=True))
    served = UnloadedVersionsLeave(metrics.registry, grace_s=60, clock=lambda: now[0])

    def versions() -> set[str]:  # the model versions the served series name
        served_samples = [s for f in served.collect() if f.name != "python_info" for s in f.samples]
        return {s.labels["version"] for s in served_samples if "version" in s.labels}

    for version in ("1", "2"):
        metrics.versions.loaded(_labels(version))
        metrics.triton.loaded(["mha", "mha_sequence"], version)
        metrics.triton.requests("mha", version, [0.001], [])
    metrics.triton.requests("mha", "3", [0.001], [])  # counted by a worker that died: no mha_model_info
    assert versions() == {"1", "2", "3"}  # the grace of 3 begins
    metrics.versions.unloaded(_labels("1"))
    now[0] = 1.0
    assert versions() == {"1", "2", "3"}  # a read finds 1 unloaded at 1: its grace begins
    now[0] = 60.0
    assert versions() == {"1", "2"}
    now[0] = 61.0
    assert versions() == {"2"}
    text = generate_latest(served_registry(metrics.registry, 0)).decode()
    assert 'version="1"' not in text
    assert 'nv_inference_request_success{model="mha",version="2"} 1.0' in text
    assert "process_cpu_seconds_total" in text and "python_info{" in text  # what names no model version stays
    metrics.versions.loaded(_labels("1"))
    assert versions() == {"1", "2"}
    metrics.versions.unloaded(_labels("1"))
    assert versions() == {"1", "2"}  # unloaded again: a new grace


def test_versions_gone_from_metrics_leave_the_registry_and_come_back_from_zero() -> None:
    """A server that follows a repository, 30 versions in turn: once a version's series have left
    /metrics, the registry drops them too, so that it holds those of the version loaded only, not
    of every version it served (each read collects them all). Loaded again, a version counts from
    zero, a counter reset to Prometheus."""
    now = [0.0]
    metrics = Metrics(CollectorRegistry(auto_describe=True))
    served = UnloadedVersionsLeave(metrics.registry, grace_s=60, clock=lambda: now[0], forget=metrics.forget)

    def held() -> collections.Counter[str]:  # series the registry itself holds, by version
        samples = [s for f in metrics.registry.collect() if f.name.startswith(("mha_", "nv_")) for s in f.samples]
        return collections.Counter(s.labels["version"] for s in samples if "version" in s.labels)

    def serve(version: str) -> None:
        metrics.versions.loaded(_labels(version))
        metrics.triton.loaded(["mha", "mha_sequence"], version)
        metrics.triton.requests("mha", version, [0.001], [])
        metrics.requests.observe_answers("mha", version, 64, [0.001])
        metrics.requests.observe_batches([(BatchEvent(1, 1, (64,), 0, 0.001, 0.001, "ort-cpu"), "mha", version)])

    serve("1")
    one_version = held()["1"]
    for n in range(2, 31):
        serve(str(n))
        metrics.versions.unloaded(_labels(str(n - 1)))
        list(served.collect())  # the grace of n - 1 begins
        now[0] += 61
        list(served.collect())  # over: its series leave, and the registry forgets them
    assert held() == {"30": one_version}
    serve("1")  # loaded again
    assert metrics.registry.get_sample_value("nv_inference_request_success", {"model": "mha", "version": "1"}) == 1.0
    assert held()["1"] == one_version
