"""The balancer and KServe manifests against their CRDs' own schemas (tests/deploy/schemas/crds),
strictly: an undeclared field is an error, as `kubectl apply --validate=strict` makes it."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.test_k8s import render
from tests.support import ROOT

CRDS = Path(__file__).parent / "schemas" / "crds"
KSERVE = ROOT / "deploy" / "kserve"


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict schema."""
    found = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        found[(f"{crd['group']}/{crd['version']}", crd["kind"])] = strict(crd["schema"])
    return found


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Every object that declares its properties refuses others, unless the schema keeps unknown
    fields (x-kubernetes-preserve-unknown-fields) or says what they hold (additionalProperties).
    The object's metadata is an ObjectMeta in the API server, not in the CRD: name and labels only."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    for field in ("apiVersion", "kind"):  # every object has them; some CRDs leave them to the API server
        schema["properties"].setdefault(field, {"type": "string"})
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    return schema


def _errors(doc: dict[str, Any]) -> list[str]:
    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


OVERLAY_CRDS = {
    "cpu-gateway-api": {"GRPCRoute", "HTTPRoute", "BackendTrafficPolicy"},
    "cpu-istio": {"DestinationRule"},
    "cpu-keda": {"ScaledObject"},
}


@pytest.mark.parametrize("overlay", sorted(OVERLAY_CRDS))
def test_balancer_and_autoscaler_objects_validate_against_their_crds(overlay: str) -> None:
    custom = [d for d in render(overlay) if (d["apiVersion"], d["kind"]) in crd_schemas()]
    assert {d["kind"] for d in custom} == OVERLAY_CRDS[overlay]
    for doc in custom:
        assert _errors(doc) == [], doc["kind"]


def test_kserve_runtime_and_inference_service_validate_against_kserve_crds() -> None:
    docs = [yaml.safe_load((KSERVE / name).read_text()) for name in ("servingruntime.yaml", "inferenceservice.yaml")]
    assert [d["kind"] for d in docs] == ["ServingRuntime", "InferenceService"]
    for doc in docs:
        assert _errors(doc) == [], doc["kind"]
    runtime, service = docs
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2"]  # the one port KServe routes: gRPC
    (container,) = runtime["spec"]["containers"]
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("h2c", 8001)]
    assert {e["name"]: e["value"] for e in container["env"]}["MHA_HTTP_PORT"] == "off"  # not advertised, not open
    sc = container["securityContext"]  # Pod Security "restricted", from the container alone
    assert sc["runAsNonRoot"] and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert "/mnt/models" in runtime["spec"]["containers"][0]["args"]  # where KServe puts storageUri's files


def test_the_validation_refuses_a_misspelled_field() -> None:
    """Not vacuous: a field the CRD does not declare, a wrong type, and a value outside an enum."""
    policy = next(d for d in render("cpu-gateway-api") if d["kind"] == "BackendTrafficPolicy")
    misspelled = copy.deepcopy(policy)
    misspelled["spec"]["loadBalancer"]["consistentHash"]["headerName"] = "mha-sequence-id"
    assert any("headerName" in e for e in _errors(misspelled))
    wrong_type = copy.deepcopy(policy)
    wrong_type["spec"]["loadBalancer"]["type"] = "Sticky"
    assert _errors(wrong_type)
    rule = next(d for d in render("cpu-istio") if d["kind"] == "DestinationRule")
    rule = copy.deepcopy(rule)
    rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeader"] = "mha-sequence-id"
    assert _errors(rule)


def test_every_balancer_hashes_on_the_header_clients_send() -> None:
    from service.protocol.inference import SEQUENCE_HEADER

    ingress = [d for d in render("cpu-ingress-nginx") if d["kind"] == "Ingress"]
    assert len(ingress) == 2
    header = "$http_" + SEQUENCE_HEADER.replace("-", "_")
    for doc in ingress:  # the key the controller's http-snippet makes from the header (test_ingress_key.py)
        assert doc["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$mha_balance_key"
    assert (
        f"map {header} $mha_balance_key"
        in (ROOT / "deploy/k8s/components/ingress-nginx/controller-values.yaml").read_text()
    )
    policy = next(d for d in render("cpu-gateway-api") if d["kind"] == "BackendTrafficPolicy")
    assert policy["spec"]["loadBalancer"]["consistentHash"]["header"]["name"] == SEQUENCE_HEADER
    rule = next(d for d in render("cpu-istio") if d["kind"] == "DestinationRule")
    assert rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == SEQUENCE_HEADER
    conf = (ROOT / "deploy" / "nginx" / "mha-serve.conf").read_text()
    assert conf.count("hash $mha_balance_key consistent;") == 2 and f"map {header} $mha_balance_key" in conf


def test_keda_scales_the_deployment_on_queue_over_compute_and_owns_the_hpa() -> None:
    """One HPA per Deployment: KEDA makes its own, so the overlay has none of ours. The query
    names only metrics the server exports, over the pods the ServiceMonitor scrapes."""
    import re

    from prometheus_client import CollectorRegistry

    from service.metrics import Metrics

    docs = render("cpu-keda")
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # an install moving from the HPA overlays: KEDA takes their HPA over instead of refusing
    assert scaled["metadata"]["annotations"]["scaledobject.keda.sh/transfer-hpa-ownership"] == "true"
    hpa = next(d for d in render("cpu") if d["kind"] == "HorizontalPodAutoscaler")
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["name"] == hpa["metadata"]["name"]
    assert "fallback" not in scaled["spec"]  # refused beside metricType Value before KEDA 2.18
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.requests.inference_duration.labels(backend="torch-cpu", model="mha", version="1").observe(
        0.001
    )  # a child exists
    metrics.requests.queue_duration.labels(model="mha", version="1").observe(0.001)
    exported = {s.name for family in registry.collect() for s in family.samples}
    used = set(re.findall(r"\b(mha_[a-z_]+)\{", query))
    assert used == {
        "mha_queue_duration_seconds_sum",
        "mha_queue_duration_seconds_count",
        "mha_inference_duration_seconds_sum",
        "mha_inference_duration_seconds_count",
    }
    assert used <= exported, used - exported
    wrong = copy.deepcopy(scaled)
    wrong["spec"]["triggers"][0]["metadata"]["threshold"] = 0.5  # KEDA's metadata values are strings
    assert _errors(wrong)


def test_the_kserve_pods_are_scraped_by_a_podmonitor_on_the_metrics_port() -> None:
    """kube-prometheus-stack ignores the runtime's prometheus.kserve.io annotations: the PodMonitor
    selects the InferenceService's pods through the one declared port (gRPC's) and moves the
    address to the metrics port the runtime sets."""
    monitor = yaml.safe_load((KSERVE / "podmonitor.yaml").read_text())
    assert _errors(monitor) == []
    service = yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    (container,) = runtime["spec"]["containers"]
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "serving.kserve.io/inferenceservice": service["metadata"]["name"]
    }
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    metrics_port = {e["name"]: e["value"] for e in container["env"]}["MHA_METRICS_PORT"]
    assert endpoint["relabelings"] == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_ip"],
            "targetLabel": "__address__",
            "replacement": f"${{1}}:{metrics_port}",
        }
    ]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    broken = copy.deepcopy(monitor)
    broken["spec"]["podMetricsEndpoints"][0]["prot"] = "h2c"
    assert _errors(broken)  # not vacuous
