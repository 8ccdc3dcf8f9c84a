"""A real Prometheus scrapes the live server while traffic flows; every dashboard query, and every
query the runbooks give, returns data."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.client.client import InferenceError, MHAClient
from tests.deploy.test_prometheus_rules import RUNBOOK_PAGE
from tests.support import ROOT, ServerThread, free_ports, make_settings, until

PROMETHEUS = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "prometheus"
PROMTOOL = PROMETHEUS.with_name("promtool")
DASHBOARD = ROOT / "deploy" / "grafana" / "mha-serve.json"
RULES = ROOT / "deploy" / "prometheus"
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


FILTERS = ("namespace", "job", "pod", "instance")  # what kube-prometheus users filter by
FROM_DCGM = "max by (namespace, pod) (DCGM_FI_DEV_"  # the GPU panel's queries: DCGM's series joined on our pods
# Queries as Triton users' request panels and alerts write them against Triton's series (request
# and failure rates, the mean batch, queue and compute time per request, pending requests), each
# with its lowest sensible value.
MHA = '{model="mha"}'
PER_REQUEST = f"rate(nv_inference_request_success{MHA}[10s])"
TRITON_QUERIES = (
    (f"sum by (model, version) (rate(nv_inference_request_success{MHA}[10s]))", 1.0),
    (f"sum by (model, version) (rate(nv_inference_request_failure{MHA}[10s]))", 0.0),
    (f"rate(nv_inference_count{MHA}[10s]) / rate(nv_inference_exec_count{MHA}[10s])", 1.0),  # the mean batch
    (f"delta(nv_inference_queue_duration_us{MHA}[10s]) / (1 + delta(nv_inference_request_success{MHA}[10s]))", 0.0),
    (f"rate(nv_inference_compute_infer_duration_us{MHA}[10s]) / {PER_REQUEST}", 1.0),  # µs per request
    (f"rate(nv_inference_request_duration_us{MHA}[10s]) / {PER_REQUEST}", 1.0),
    (f"nv_inference_pending_request_count{MHA}", 0.0),
)

# Triton's own published dashboard (triton-inference-server/server, deploy/k8s-onprem/dashboard.json),
# its queries verbatim, each with the value one replica serving `mha` gives (pod as Kubernetes labels it).
TRITON_DASHBOARD = (
    ("count(count(nv_inference_count) by (instance))", 1.0, 1.0),  # Active Triton Instances
    (  # Proportion of Requests by Pod
        "sum by (pod) (rate(nv_inference_count[1m])) / ignoring(pod) group_left sum (rate(nv_inference_count[1m]))",
        1.0,
        1.0,
    ),
    ("sum(nv_inference_request_success) by (pod)", 1.0, float("inf")),  # Cumulative Inference Requests by Pod
    ("sum(nv_inference_request_failure) by (pod)", 1.0, float("inf")),  # (the traffic's client mistakes)
    ("sum(rate(nv_inference_compute_infer_duration_us[30s])) by (model) / 1000", 0.0, float("inf")),  # ms/s by model
    (  # Average Queue Time by Pod (microseconds)
        "avg(rate(nv_inference_queue_duration_us[30s])/(1+rate(nv_inference_request_success[30s]))) by (pod)",
        0.0,
        float("inf"),
    ),
)


def fill(expr: str, instance: str) -> str:
    """The query as Grafana sends it: one instance (or all), every other filter on All (.*)."""
    for name in ("namespace", "job", "pod"):
        expr = expr.replace(f"${name}", ".*")
    return expr.replace("$instance", instance).replace("$__rate_interval", "10s").replace("$__range", "1m")


def api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in FILTERS:
        assert variables[name]["includeAll"] and variables[name]["multi"] and variables[name]["allValue"] == ".*"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            for name in FILTERS:
                assert f'{name}=~"${name}"' in target["expr"], (panel["title"], name, target["expr"])
    assert [link["url"] for link in dashboard["links"]] == [RUNBOOK_PAGE]  # on-call's way to what each alert means
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for needed in (
        "request rate",
        "error ratio",
        "latency",
        "queue time",
        "compute",
        "batch size",
        "tokens",
        "in flight",
        "backend",
        "fallback",
        "sequences",
        "evictions",
    ):
        assert needed in titles, needed
    exprs = " ".join(e for _, e in dashboard_queries())
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(mha_request_duration_seconds_bucket" in exprs


@pytest.fixture(scope="module")
def scraped(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """A live server under traffic (a client's mistakes among it), scraped every second by a real
    Prometheus that evaluates alerts.yml: (Prometheus's port, the server's instance)."""
    assert PROMETHEUS.exists(), "make install unpacks Debian's prometheus into .tools/"
    tmp_path = tmp_path_factory.mktemp("prometheus")
    metrics_port, prom_port = free_ports(2)
    settings = make_settings(small_model_dir, metrics_port=metrics_port, max_batch_size=8, max_queue_delay_ms=5)
    instance = f"127.0.0.1:{metrics_port}"
    shutil.copy(RULES / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [alerts.yml]\n"
        f"scrape_configs:\n  - job_name: mha-serve\n"
        f"    static_configs: [{{targets: ['{instance}'], labels: {{pod: mha-serve-0}}}}]\n"
    )
    stop = threading.Event()
    with ServerThread(settings) as server:

        def traffic(seed: int) -> None:
            rng = np.random.default_rng(seed)
            with MHAClient(server.url) as client:
                while not stop.is_set():
                    T = int(rng.integers(1, 65))
                    client.infer(rng.standard_normal((int(rng.integers(1, 4)), T, 32), dtype=np.float32))
                    if rng.random() < 0.2:
                        with contextlib.suppress(InferenceError):  # a client mistake, for the error panels
                            client.infer(np.ones((1, 2, 7), np.float32))

        workers = [threading.Thread(target=traffic, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        prom = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        try:
            _wait_for_samples(prom_port, instance, prom)
            yield prom_port, instance
        finally:
            stop.set()
            for w in workers:
                w.join(30)
            prom.terminate()
            prom.wait(30)


def test_every_dashboard_query_returns_data(scraped: tuple[int, str]) -> None:
    prom_port, instance = scraped
    instances = api(prom_port, "label/instance/values", **{"match[]": "mha_ready"})["data"]
    assert instance in instances  # the dashboard's $instance variable query
    failures = []
    for title, expr in dashboard_queries():
        for value in (instance, ".*"):
            result = api(prom_port, "query", query=fill(expr, value))
            # DCGM's series come from NVIDIA's exporter, which runs only on GPU nodes: those
            # queries must be valid here, and return data where DCGM runs
            empty_allowed = expr.startswith(FROM_DCGM)
            if result["status"] != "success" or not (result["data"]["result"] or empty_allowed):
                failures.append((title, fill(expr, value), result.get("error", "empty result")))
    assert not failures, failures
    for expr, lowest in TRITON_QUERIES:  # a Triton user's dashboard reads this server unchanged
        result = api(prom_port, "query", query=expr)["data"]["result"]
        assert result and all(float(r["value"][1]) >= lowest for r in result), (expr, result)
    for expr, low, high in TRITON_DASHBOARD:
        result = api(prom_port, "query", query=expr)["data"]["result"]
        values = [float(r["value"][1]) for r in result]
        assert values and all(low <= v <= high for v in values), (expr, result)
        assert all(r["metric"].get("pod", "mha-serve-0") == "mha-serve-0" for r in result), (expr, result)
    rules = api(prom_port, "rules")["data"]["groups"]
    assert {r["name"] for g in rules for r in g["rules"]} >= {"MHAServeTargetDown", "MHAServeBackendFallback"}


def runbook_queries() -> list[str]:
    return [" ".join(q.split()) for q in re.findall(r"```promql\n(.*?)```", RUNBOOKS.read_text(), flags=re.S)]


# Series a one-process plaintext CPU server without token files does not export: NVIDIA's
# exporter's (GPU nodes), --require-device's, --tls-cert's expiry (0, filtered out, without TLS),
# the watched files' gauge and the supervisor's count of workers replaced (--workers)
ELSEWHERE = (
    "DCGM_",
    "mha_device_required",
    "mha_tls_certificate_expiry",
    "mha_watched_files_refused",
    "mha_worker_restarts_total",
)


def test_every_runbook_query_answers(scraped: tuple[int, str]) -> None:
    """What docs/runbooks.md tells on-call to query is valid PromQL over series this server exports:
    each returns data, but for the series only other servers export (ELSEWHERE)."""
    prom_port, _ = scraped
    queries = runbook_queries()
    assert len(queries) >= 14
    failures = []
    for query in queries:
        result = api(prom_port, "query", query=query)
        empty_allowed = any(name in query for name in ELSEWHERE)
        if result["status"] != "success" or not (result["data"]["result"] or empty_allowed):
            failures.append((query, result.get("error", "empty result")))
    assert not failures, failures


def _ready(port: int, prom: subprocess.Popen[bytes]) -> bool:
    """Prometheus's /-/ready answers 200: its API answers 503 while the TSDB still opens, which
    takes seconds on a busy 2-core machine."""
    if prom.poll() is not None:
        pytest.fail(f"prometheus exited with {prom.returncode}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as response:
            return response.status == 200
    except OSError:  # not listening yet, or 503 while it starts
        return False


def _wait_for_samples(port: int, instance: str, prom: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prom.poll() is not None:
            pytest.fail(f"prometheus exited with {prom.returncode}")
        try:
            result = api(port, "query", query=f'count_over_time(up{{instance="{instance}"}}[1m])')["data"]["result"]
            if result and float(result[0]["value"][1]) >= 12:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail("prometheus did not collect 12 scrapes in time")


def test_latency_buckets_carry_trace_ids_that_prometheus_stores_as_exemplars(
    small_model_dir: Path, tmp_path: Path
) -> None:
    """Tracing on: a real Prometheus with exemplar storage scrapes our OpenMetrics exposition, and
    its exemplar API returns the trace ids our exporter sent (so a click on a slow bucket in the
    dashboard opens that request's trace)."""
    from tests.otlp_receiver import OtlpReceiver

    metrics_port, prom_port = free_ports(2)
    instance = f"127.0.0.1:{metrics_port}"
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: mha-serve\n    static_configs: [{{targets: ['{instance}']}}]\n"
    )
    started = time.time()
    with OtlpReceiver() as receiver:
        settings = make_settings(small_model_dir, metrics_port=metrics_port, otlp_endpoint=receiver.endpoint)
        with ServerThread(settings) as server:
            prom = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--enable-feature=exemplar-storage",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "prometheus.log").open("w"),
            )
            try:
                until(lambda: _ready(prom_port, prom), timeout_s=60, every_s=0.2, what="prometheus is ready")
                found: list[dict] = []
                deadline = time.monotonic() + 60
                with MHAClient(server.url) as client:
                    while not found and time.monotonic() < deadline:
                        client.infer(np.ones((1, 4, 32), np.float32))
                        time.sleep(0.2)
                        result = api(
                            prom_port,
                            "query_exemplars",
                            query='mha_request_duration_seconds_bucket{method="ModelInfer"}',
                            start=str(started - 60),
                            end=str(time.time() + 60),
                        )
                        found = [e for series in result.get("data") or [] for e in series["exemplars"]]
                assert server.engine.tracing.flush()
            finally:
                prom.terminate()
                prom.wait(30)
        traced = {s.trace_id for s in receiver.named("ModelInfer")}
    assert found, "prometheus stored no exemplar"
    ids = {e["labels"]["trace_id"] for e in found}
    assert ids <= traced, (ids, len(traced))  # each one a trace our exporter delivered
