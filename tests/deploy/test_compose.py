"""docker-compose.yml, checked offline (no Docker engine here): what it mounts exists, ports and
hosts agree between the server, Prometheus and Grafana, and Prometheus accepts its config."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from service.settings import Settings
from tests.support import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PROMTOOL = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool"


def _mounts(service: str) -> dict[str, Path]:
    """Container path -> repository path of each bind mount."""
    out = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        out[target] = ROOT / source
    return out


def test_the_server_is_built_from_our_image_on_our_ports() -> None:
    mha: dict[str, Any] = COMPOSE["services"]["mha"]
    assert (ROOT / mha["build"]["dockerfile"]).is_file()
    defaults = Settings()
    published = {int(p.split(":")[1]) for p in mha["ports"]}
    assert published == {defaults.http_port, defaults.grpc_port, defaults.metrics_port}


def test_every_mounted_file_exists() -> None:
    for service in COMPOSE["services"]:
        for target, source in _mounts(service).items():
            assert source.exists(), f"{service}: {source} (for {target}) is missing"


def test_prometheus_scrapes_the_server_and_accepts_its_config(tmp_path: Path) -> None:
    mounts = _mounts("prometheus")
    config_path = next(s for t, s in mounts.items() if t.endswith("prometheus.yml"))
    config = yaml.safe_load(config_path.read_text())
    (target,) = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"mha:{Settings().metrics_port}"
    for container_path, source in mounts.items():  # lay the files out as the container sees them
        shutil.copy(source, tmp_path / Path(container_path).name)
    command = [str(PROMTOOL), "check", "config", str(tmp_path / "prometheus.yml")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    mounts = _mounts("grafana")
    datasources = yaml.safe_load((mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((mounts["/etc/grafana/provisioning/dashboards"] / "mha-serve.yml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    dashboards = [t for t, s in mounts.items() if t.startswith(folder + "/")]
    assert dashboards and mounts[dashboards[0]] == ROOT / "deploy" / "grafana" / "mha-serve.json"
