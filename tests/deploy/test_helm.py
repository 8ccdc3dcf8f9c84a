"""The Helm chart (deploy/helm/mha-serve), rendered and linted by Helm's own library (Helm 4's, from
PyPI's helm-python-sdk): with its defaults it renders what the kustomize cpu overlay renders
(compared object by object, so the two cannot drift), its objects validate strictly against
Kubernetes 1.30, its values are checked by values.schema.json, a config change rolls the pods,
and `helm test` checks the served answers against the float64 reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helm_python import chart as helm
from helm_python.errors import HelmRenderError, HelmValuesError

from tests.deploy.test_crds import _errors
from tests.deploy.test_k8s import GENERATED, SCHEMAS, _validate, base_name, by_kind, render
from tests.support import ROOT

CHART = ROOT / "deploy" / "helm" / "mha-serve"
RELEASE, NAMESPACE = "mha-serve", "serving"
TOKENS = {"tokenSecret": "mha-serve-token", "adminTokenSecret": "mha-serve-admin-token"}  # the overlay's Secrets
TLS = {"secret": "mha-serve-tls"}  # the cpu-tls overlay's Secret
MTLS = {**TLS, "clientSecret": "mha-serve-test-client"}  # and the certificate helm test presents
CHART_ONLY = ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "helm.sh/chart")  # Helm's labels


def _render(values: dict[str, Any] | None = None, release: str = RELEASE) -> dict[str, str]:
    return helm.Chart.load(CHART).render(values, name=release, namespace=NAMESPACE, is_install=True)


def _objects(values: dict[str, Any] | None = None, release: str = RELEASE, tests: bool = False) -> list[dict[str, Any]]:
    rendered = _render(values, release)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml") and ("/tests/" in path) == tests:
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def _of(docs: list[dict[str, Any]], kind: str, name: str = RELEASE) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _without_helms_own(value: Any) -> Any:
    """`value` with Helm's labels and the config checksum taken out, wherever they are."""
    if isinstance(value, dict):
        return {
            k: _without_helms_own(v)
            for k, v in value.items()
            if k not in CHART_ONLY and k != "checksum/config" and not (k == "annotations" and _only_checksum(v))
        }
    if isinstance(value, list):
        return [_without_helms_own(v) for v in value]
    return value


def _only_checksum(annotations: Any) -> bool:
    return isinstance(annotations, dict) and set(annotations) <= {"checksum/config"}


def test_with_its_defaults_the_chart_renders_what_kustomize_renders() -> None:
    def unhashed(doc: dict[str, Any]) -> dict[str, Any]:  # the generated ConfigMap's name, as the chart names it
        return json.loads(GENERATED.sub(r"\1", json.dumps(doc)))

    kustomized = {(d["kind"], base_name(d)): unhashed(d) for d in render("cpu")}
    charted = {(d["kind"], d["metadata"]["name"]): d for d in _objects()}
    assert set(charted) == set(kustomized)
    for key, ours in charted.items():
        theirs, mine = kustomized[key], _without_helms_own(ours)
        if key == ("ConfigMap", "mha-serve-dashboard"):
            assert json.loads(mine["data"]["mha-serve.json"]) == json.loads(theirs["data"]["mha-serve.json"])
            continue
        mine["metadata"]["labels"] = theirs["metadata"].get("labels", {}) | {
            k: v for k, v in mine["metadata"].get("labels", {}).items() if k not in theirs["metadata"].get("labels", {})
        }
        assert mine == theirs, key


def test_every_object_carries_the_release_so_two_installs_never_overlap() -> None:
    one, two = _objects(release="mha-serve"), _objects(release="canary")
    names = {"canary-mha-serve", "canary-mha-serve-config", "canary-mha-serve-headless", "canary-mha-serve-dashboard"}
    assert {d["metadata"]["name"] for d in two} == names
    for doc in one + two:
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] in ("mha-serve", "canary")
    selector = _of(two, "Deployment", "canary-mha-serve")["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/instance"] == "canary"
    assert _of(two, "Service", "canary-mha-serve")["spec"]["selector"] == selector


def test_the_objects_validate_strictly_against_1_30_and_lint_clean(tmp_path: Path) -> None:
    values = [None, {"gpu": {"enabled": True, "memoryLimitMb": 20000, "runtimeClassName": "nvidia"}},
              {"autoscaling": {"mode": "none"}, "replicaCount": 3, "priorityClassName": "inference"},
              {"model": {"source": "checkpoint"}}, {"model": {"source": "repository"}}, {"auth": TOKENS},
              {"tls": TLS, "auth": TOKENS}, {"tls": MTLS}]  # fmt: skip
    for i, v in enumerate(values):
        path = tmp_path / f"{i}.yaml"
        path.write_text(yaml.safe_dump_all(_objects(v) + _objects(v, tests=True)))
        run = _validate(path)
        assert run.returncode == 0, (v, run.stdout + run.stderr)
        report = helm.lint(CHART, v, strict=True, namespace=NAMESPACE, kube_version="1.30.0")
        assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"autoscaling": {"mode": "keda2"}}, "/autoscaling/mode"),
        ({"image": {"repository": "mha-serve", "tag": "latest"}}, "/image/tag"),
        ({"image": {"repository": "mha-serve", "digest": "sha256:beef"}}, "/image/digest"),
        ({"config": {"THREADS": "4"}}, "'THREADS' does not match"),
        ({"gpu": {"count": 0}}, "/gpu/count"),
        ({"replicas": 3}, "replicas"),
        ({"auth": {"tokenSecret": "My_Token"}}, "/auth/tokenSecret"),
        ({"tls": {"secret": "My_Cert"}}, "/tls/secret"),
        ({"tls": {"clientSecret": "My_Client"}}, "/tls/clientSecret"),
        ({"monitoring": {"runbooks": "https://wiki.example.com/runbooks#alerts"}}, "/monitoring/runbooks"),
    ],
)
def test_the_values_schema_refuses_what_would_not_work(values: dict[str, Any], says: str) -> None:
    with pytest.raises(HelmValuesError, match=says):
        helm.Chart.load(CHART).validate_schema(values)


def test_a_config_change_rolls_the_pods_and_the_same_config_does_not() -> None:
    def checksum(values: dict[str, Any] | None) -> str:
        return _of(_objects(values), "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    config = copy.deepcopy(helm.Chart.load(CHART).values["config"])
    assert checksum(None) == checksum({"config": config})
    assert checksum({"config": {**config, "MHA_MAX_QUEUE_DELAY_MS": "1"}}) != checksum(None)


def test_gpu_mode_renders_the_gpu_overlays_objects() -> None:
    """gpu.enabled: the gpu overlay's pod (the GPU asked for, rolled one pod down at a time, ready
    only on CUDA, larger batches, the arena capped) and its HPA on queue time alone."""
    values = {"image": {"repository": "mha-serve", "tag": "0.1.0-gpu"}, "gpu": {"enabled": True},
              "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}  # fmt: skip
    docs = _objects(values)
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == {(d["kind"], base_name(d)) for d in render("gpu")}
    for kind in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        theirs = json.loads(GENERATED.sub(r"\1", json.dumps(by_kind("gpu", kind))))
        assert _without_helms_own(_of(docs, kind))["spec"] == theirs["spec"], kind


def test_gpu_values_ask_for_the_device_cap_its_memory_and_land_on_gpu_nodes() -> None:
    values = {
        "gpu": {
            "enabled": True,
            "resourceName": "nvidia.com/mig-1g.18gb",
            "memoryLimitMb": 16000,
            "runtimeClassName": "nvidia",
            "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"},
        }
    }
    docs = _objects(values)
    pod = _of(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/mig-1g.18gb"] == "1"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"name": "MHA_GPU_MEM_LIMIT_MB", "value": "16000"} in pod["containers"][0]["env"]
    cpu_pod = _of(_objects(), "Deployment")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in cpu_pod and "tolerations" not in cpu_pod and "nodeSelector" not in cpu_pod


def test_autoscaling_off_sets_the_replicas_and_drops_the_hpa() -> None:
    docs = _objects({"autoscaling": {"mode": "none"}, "replicaCount": 3})
    assert _of(docs, "Deployment")["spec"]["replicas"] == 3
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert "replicas" not in _of(_objects(), "Deployment")["spec"]  # the HPA owns the count


def test_helm_test_verifies_the_served_answers_and_notes_say_how_to_reach_it() -> None:
    (pod,) = _objects(tests=True)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    every_route = ["--url", "mha-serve:8001", "--http-url", "http://mha-serve:8000"]  # gRPC's and HTTP's
    assert pod["spec"]["containers"][0]["args"] == ["mha", "verify", "/opt/mha/model", *every_route]
    (no_http,) = _objects({"config": {"MHA_HTTP_PORT": "off"}}, tests=True)  # HTTP turned off: gRPC alone
    assert no_http["spec"]["containers"][0]["args"] == ["mha", "verify", "/opt/mha/model", "--url", "mha-serve:8001"]
    (renamed,) = _objects({"config": {"MHA_MODEL_NAME": "attention"}}, tests=True)  # the name the server answers to
    assert renamed["spec"]["containers"][0]["args"][3:7] == ["--url", "mha-serve:8001", "--model", "attention"]
    assert pod["metadata"]["labels"]["mha-serve-client"] == "true"  # let through by the NetworkPolicy
    assert (
        pod["spec"]["containers"][0]["image"]
        == _of(_objects(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    notes = _render()["mha-serve/templates/NOTES.txt"]
    assert "kubectl -n serving port-forward svc/mha-serve 8001:8001" in notes
    assert "mha infer --url 127.0.0.1:8001" in notes and "helm test mha-serve -n serving" in notes


def test_an_image_digest_wins_over_the_tag() -> None:
    digest = "sha256:" + "a" * 64
    pod = _of(_objects({"image": {"repository": "registry.example/mha-serve", "digest": digest}}), "Deployment")
    assert pod["spec"]["template"]["spec"]["containers"][0]["image"] == f"registry.example/mha-serve@{digest}"


def test_keda_mode_scales_on_this_releases_queue_time_alone() -> None:
    """The ScaledObject of the cpu-keda overlay, valid under KEDA's CRD, its query matching this
    release's namespace (two installs sharing a Prometheus never scale on each other's queue)."""
    docs = _objects({"autoscaling": {"mode": "keda"}})
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert _errors(scaled) == []
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes and owns it
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert query.count('{job="mha-serve", namespace="serving"}') == 4
    theirs = copy.deepcopy(by_kind("cpu-keda", "ScaledObject"))
    mine = _without_helms_own(scaled)
    mine["spec"]["triggers"][0]["metadata"]["query"] = " ".join(query.replace(', namespace="serving"', "").split())
    their_query = theirs["spec"]["triggers"][0]["metadata"]
    their_query["query"] = " ".join(their_query["query"].split())
    assert mine["spec"] == theirs["spec"]  # the same signal and behaviour as the kustomize component
    assert _of(docs, "ConfigMap", "mha-serve-config")["data"]["MHA_REQUIRE_SEQUENCE_OFFSET"] == "true"


@pytest.mark.parametrize(
    ("kind", "schema"), [("ServiceMonitor", "servicemonitor_v1.json"), ("PrometheusRule", "prometheusrule_v1.json")]
)
def test_monitoring_renders_the_monitoring_components_objects(kind: str, schema: str) -> None:
    """The ServiceMonitor and the PrometheusRule (the alerts of deploy/prometheus/alerts.yml) as
    components/monitoring has them, valid under the Prometheus Operator's schemas, selected by
    kube-prometheus-stack's release label; the ServiceMonitor scrapes this release's pods alone."""
    docs = _objects({"monitoring": {"serviceMonitor": True, "prometheusRule": True}})
    ours = _of(docs, kind)
    jsonschema.validate(ours, json.loads((SCHEMAS / schema).read_text()))
    assert ours["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    theirs = by_kind("cpu-prometheus", kind)
    assert _without_helms_own(ours)["spec"] == theirs["spec"]
    if kind == "ServiceMonitor":
        assert ours["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    assert not [d for d in _objects() if d["kind"] == kind]  # off by default: no CRDs needed


def test_monitoring_runbooks_moves_every_alerts_runbook_url_and_nothing_else() -> None:
    """A fork or an internal wiki keeps its own runbooks: each alert's runbook_url becomes that page,
    anchored at the alert's name, and so does the dashboard's link; the rules are otherwise those
    of alerts.yml."""
    page = "https://wiki.example.com/mha-serve/runbooks"
    docs = _objects({"monitoring": {"prometheusRule": True, "runbooks": page}})
    dashboard = json.loads(_of(docs, "ConfigMap", f"{RELEASE}-dashboard")["data"]["mha-serve.json"])
    assert [link["url"] for link in dashboard["links"]] == [page]  # the dashboard's link to them too
    moved = _of(docs, "PrometheusRule")
    alerts = [r for g in moved["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == 21 and all(r["annotations"]["runbook_url"] == f"{page}#{r['alert'].lower()}" for r in alerts)
    ours = copy.deepcopy(by_kind("cpu-prometheus", "PrometheusRule")["spec"])  # by_kind's renders are shared
    for group in ours["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:  # not the recording rules
                rule["annotations"]["runbook_url"] = f"{page}#{rule['alert'].lower()}"
    assert moved["spec"] == ours


def test_gateway_api_routing_renders_the_gateway_api_overlays_objects() -> None:
    """routing.gatewayApi: the cpu-gateway-api overlay's routes and hashing policy, valid under
    their CRDs, its proxies let in by the NetworkPolicy, and steps required to say their offset."""
    docs = _objects({"routing": {"gatewayApi": {"enabled": True}}})
    for kind, name in [("GRPCRoute", RELEASE), ("HTTPRoute", RELEASE), ("BackendTrafficPolicy", "mha-serve-sequences")]:
        ours = _of(docs, kind, name)
        assert _errors(ours) == [], kind
        assert _without_helms_own(ours)["spec"] == by_kind("cpu-gateway-api", kind, name)["spec"], kind
    policy = _of(docs, "NetworkPolicy")["spec"]
    assert policy["ingress"] == by_kind("cpu-gateway-api", "NetworkPolicy")["spec"]["ingress"]
    assert _of(docs, "ConfigMap", "mha-serve-config")["data"]["MHA_REQUIRE_SEQUENCE_OFFSET"] == "true"


@pytest.mark.parametrize(
    ("routing", "overlay", "objects"),
    [
        ("istio", "cpu-istio", [("DestinationRule", "mha-serve")]),
        ("ingressNginx", "cpu-ingress-nginx", [("Ingress", "mha-serve-grpc"), ("Ingress", "mha-serve-http")]),
    ],
)
def test_istio_and_ingress_nginx_routing_render_their_overlays_objects(
    routing: str, overlay: str, objects: list[tuple[str, str]]
) -> None:
    docs = _objects({"routing": {routing: {"enabled": True}}})
    for kind, name in objects:
        ours = _without_helms_own(_of(docs, kind, name))
        theirs = by_kind(overlay, kind, name)
        assert ours["spec"] == theirs["spec"] and ours["metadata"].get("annotations") == theirs["metadata"].get(
            "annotations"
        ), name
        if kind != "Ingress":
            assert _errors(_of(docs, kind, name)) == []
    assert _of(docs, "NetworkPolicy")["spec"]["ingress"] == by_kind(overlay, "NetworkPolicy")["spec"]["ingress"]
    assert _of(docs, "ConfigMap", "mha-serve-config")["data"]["MHA_REQUIRE_SEQUENCE_OFFSET"] == "true"


@pytest.mark.parametrize(
    ("source", "overlay"), [("checkpoint", "cpu-custom-model"), ("repository", "cpu-model-repository")]
)
def test_a_model_source_renders_its_overlays_pod_config_and_claim(source: str, overlay: str) -> None:
    """model.source checkpoint: the init container that exports and verifies the checkpoint from
    the claim (cpu-custom-model); repository: the claim served in poll mode (cpu-model-repository).
    Pod volumes, mounts, init containers, settings and the ReadWriteMany claim as the overlays."""
    docs = _objects({"model": {"source": source}})
    ours = _without_helms_own(_of(docs, "Deployment"))["spec"]["template"]["spec"]
    theirs = by_kind(overlay, "Deployment")["spec"]["template"]["spec"]
    for field in ("initContainers", "volumes"):
        assert ours.get(field) == json.loads(GENERATED.sub(r"\1", json.dumps(theirs.get(field)))), field
    assert ours["containers"][0]["volumeMounts"] == theirs["containers"][0]["volumeMounts"]
    assert (
        _of(docs, "ConfigMap", "mha-serve-config")["data"] == by_kind(overlay, "ConfigMap", "mha-serve-config")["data"]
    )
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"] == next(d for d in render(overlay) if d["kind"] == "PersistentVolumeClaim")["spec"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # an uninstall keeps the data
    tests = _objects({"model": {"source": source}}, tests=True)
    if source == "checkpoint":  # the test pod exports the same checkpoint and verifies the server against it
        (pod,) = tests
        assert pod["spec"]["initContainers"][0]["command"] == theirs["initContainers"][0]["command"]
        assert pod["spec"]["containers"][0]["args"][2] == "/models/custom"
    else:
        assert tests == []  # a repository's versions change at run time: no one directory to verify against


def test_pod_deletion_cost_renders_the_overlays_sidecar_and_role() -> None:
    """podDeletionCost.enabled: the cpu-pod-deletion-cost overlay's sidecar (after the server),
    its token volume, and its Role and RoleBinding, but for Helm's labels."""
    docs = _objects({"podDeletionCost": {"enabled": True}})
    ours = _without_helms_own(_of(docs, "Deployment"))["spec"]["template"]["spec"]
    theirs = by_kind("cpu-pod-deletion-cost", "Deployment")["spec"]["template"]["spec"]
    assert (
        [c["name"] for c in ours["containers"]]
        == [c["name"] for c in theirs["containers"]]
        == ["mha-serve", "pod-cost"]
    )
    assert ours["containers"][1] == theirs["containers"][1]
    assert ours["volumes"] == theirs["volumes"]
    for kind in ("Role", "RoleBinding"):
        mine = _without_helms_own(_of(docs, kind, "mha-serve-pod-deletion-cost"))
        assert {k: v for k, v in mine.items() if k != "metadata"} == {
            k: v
            for k, v in by_kind("cpu-pod-deletion-cost", kind, "mha-serve-pod-deletion-cost").items()
            if k != "metadata"
        }
    assert not [d for d in _objects() if d["kind"] in ("Role", "RoleBinding")]  # off by default


def test_queue_time_joins_cpu_in_the_hpa_as_the_prometheus_overlay_has_it() -> None:
    """autoscaling.queueSecondsPerRequest: the cpu-prometheus overlay's HPA, CPU and queue time
    per request (prometheus-adapter's metric), and with monitoring on, its other objects too."""
    values = {
        "autoscaling": {"queueSecondsPerRequest": "20m"},
        "monitoring": {"serviceMonitor": True, "prometheusRule": True},
    }
    docs = _objects(values)
    assert (
        _without_helms_own(_of(docs, "HorizontalPodAutoscaler"))["spec"]
        == by_kind("cpu-prometheus", "HorizontalPodAutoscaler")["spec"]
    )
    charted = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert charted == {(d["kind"], base_name(d)) for d in render("cpu-prometheus")}


def test_auth_renders_the_tokens_overlays_volume_mount_and_settings() -> None:
    """auth: the cpu-tokens overlay's projected volume of both Secrets, its read-only mount and the
    two settings that name the files. The `helm test` pod mounts the inference token alone and
    sends it; with only an admin token, inference is open and it sends none."""
    docs = _objects({"auth": TOKENS})
    ours = _without_helms_own(_of(docs, "Deployment"))["spec"]["template"]["spec"]
    theirs = by_kind("cpu-tokens", "Deployment")["spec"]["template"]["spec"]
    assert ours["volumes"] == theirs["volumes"]
    assert ours["containers"][0]["volumeMounts"] == theirs["containers"][0]["volumeMounts"]
    config = _of(docs, "ConfigMap", "mha-serve-config")["data"]
    assert config == by_kind("cpu-tokens", "ConfigMap", "mha-serve-config")["data"]
    assert config["MHA_ADMIN_TOKEN_FILE"] != config["MHA_AUTH_TOKEN_FILE"]
    (pod,) = _objects({"auth": TOKENS}, tests=True)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "tokens"]
    assert [s["secret"]["name"] for s in volume["projected"]["sources"]] == ["mha-serve-token"]  # not the admin's
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--token-file") + 1] == config["MHA_AUTH_TOKEN_FILE"]
    (pod,) = _objects({"auth": {"adminTokenSecret": "mha-serve-admin-token"}}, tests=True)
    assert "--token-file" not in pod["spec"]["containers"][0]["args"]
    assert "tokens" not in [v["name"] for v in pod["spec"]["volumes"]]
    assert "MHA_AUTH_TOKEN_FILE" not in _of(_objects(), "ConfigMap", "mha-serve-config")["data"]  # off by default


def test_tls_renders_the_tls_overlays_volume_mount_probes_and_settings() -> None:
    """tls.secret: the cpu-tls overlay's Secret volume, read-only mount, health port and probes,
    settings, and Services without h2c. The `helm test` pod mounts the Secret's CA alone, never
    the key, and reaches the Service by the name a certificate carries."""
    docs = _objects({"tls": TLS})
    ours = _without_helms_own(_of(docs, "Deployment"))["spec"]["template"]["spec"]
    theirs = by_kind("cpu-tls", "Deployment")["spec"]["template"]["spec"]
    assert ours["volumes"] == theirs["volumes"]
    for field in ("volumeMounts", "ports", "startupProbe", "livenessProbe", "readinessProbe"):
        assert ours["containers"][0][field] == theirs["containers"][0][field], field
    config = _of(docs, "ConfigMap", "mha-serve-config")["data"]
    assert config == by_kind("cpu-tls", "ConfigMap", "mha-serve-config")["data"]
    for name in ("mha-serve", "mha-serve-headless"):
        assert _of(docs, "Service", name)["spec"]["ports"] == by_kind("cpu-tls", "Service", name)["spec"]["ports"]
    (pod,) = _objects({"tls": TLS}, tests=True)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--url") + 1] == f"mha-serve.{NAMESPACE}.svc:8001"
    assert args[args.index("--http-url") + 1] == f"https://mha-serve.{NAMESPACE}.svc:8000"  # the name it carries
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert args[args.index("--tls-ca") + 1] == f"{mount['mountPath']}/ca.crt"
    assert "MHA_TLS_CERT" not in _of(_objects(), "ConfigMap", "mha-serve-config")["data"]  # off by default
    notes = _render({"tls": TLS})["mha-serve/templates/NOTES.txt"]  # a port-forward: 127.0.0.1, not that name
    assert f"--tls-server-name mha-serve.{NAMESPACE}.svc" in notes and "--tls-ca" in notes
    assert "--tls-server-name" not in _render()["mha-serve/templates/NOTES.txt"]


def test_tls_with_a_balancer_in_front_is_refused_with_the_reason() -> None:
    with pytest.raises(HelmRenderError, match=r"tls\.secret with routing: the balancer would speak plaintext"):
        _objects({"tls": TLS, "routing": {"istio": {"enabled": True}}})


def test_mtls_requires_client_certificates_and_helm_test_presents_one() -> None:
    """tls.clientSecret: the server requires client certificates signed by the CA in tls.secret's
    ca.crt, mounted beside its certificate; `helm test`'s pod presents the client Secret's
    certificate, readable by its group alone; without tls.secret it is refused, saying why."""
    docs = _objects({"tls": MTLS})
    pod = _without_helms_own(_of(docs, "Deployment"))["spec"]["template"]["spec"]
    (volume,) = [v["secret"] for v in pod["volumes"] if v["name"] == "tls"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    config = _of(docs, "ConfigMap", "mha-serve-config")["data"]
    assert {"key": "ca.crt", "path": "ca.crt"} in volume["items"]
    assert config["MHA_TLS_CLIENT_CA"] == f"{mount['mountPath']}/ca.crt"
    assert pod["volumes"] == by_kind("cpu-mtls", "Deployment")["spec"]["template"]["spec"]["volumes"]  # kustomize's
    assert config == by_kind("cpu-mtls", "ConfigMap", "mha-serve-config")["data"]
    (test,) = _objects({"tls": MTLS}, tests=True)
    spec, args = test["spec"], test["spec"]["containers"][0]["args"]
    (client,) = [v["secret"] for v in spec["volumes"] if v["name"] == "tls-client"]
    (where,) = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] == "tls-client"]
    assert client["secretName"] == MTLS["clientSecret"] and client["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]  # so it can read the key
    assert args[args.index("--tls-client-cert") + 1] == f"{where}/tls.crt"
    assert args[args.index("--tls-client-key") + 1] == f"{where}/tls.key"
    assert "MHA_TLS_CLIENT_CA" not in _of(_objects({"tls": TLS}), "ConfigMap", "mha-serve-config")["data"]
    with pytest.raises(HelmRenderError, match=r"tls\.clientSecret \(mTLS\) needs tls\.secret"):
        _objects({"tls": {"clientSecret": "mha-serve-test-client"}})
