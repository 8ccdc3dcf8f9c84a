"""`mha pod-cost`: a sidecar that keeps its pod's `controller.kubernetes.io/pod-deletion-cost`
at the number of live sequences the server beside it holds, so that a scale-down removes the
pods holding the fewest (a removed pod's sequences must be restarted with their prefix).

The server needs no rights on the Kubernetes API: this sidecar alone mounts a service account
token, allowed to patch pods (deploy/k8s/components/pod-deletion-cost). It reads the live
sequences from the server's own /metrics (`mha_sequences_active`, summed over its workers) and
patches the annotation with a JSON merge patch only when the count changed. One request over
HTTPS with the pod's token is all it needs from the API, so it uses the standard library rather
than the Kubernetes client and its dependencies.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # where Kubernetes mounts a pod's token


def live_sequences(metrics_text: str) -> int:
    """The live sequences a server's /metrics text states: mha_sequences_active, over its workers."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples
            if sample.name == "mha_sequences_active"
        )
    )


def read_metrics(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=timeout_s) as response:
        return str(response.read().decode())


def merge_patch(cost: int) -> bytes:
    """The JSON merge patch that sets the annotation (an int32, as a string)."""
    return json.dumps({"metadata": {"annotations": {ANNOTATION: str(cost)}}}).encode()


@dataclass(frozen=True)
class PodApi:
    """Where this pod is on the API server, and the files of its mounted service account."""

    api_url: str  # https://HOST:PORT
    namespace: str
    pod: str
    account: Path = ACCOUNT

    @classmethod
    def in_cluster(cls, pod: str, environ: Mapping[str, str], account: Path = ACCOUNT) -> PodApi:
        host, port = environ["KUBERNETES_SERVICE_HOST"], environ.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host  # an IPv6 service address
        return cls(f"https://{host}:{port}", (account / "namespace").read_text().strip(), pod, account)

    def patch_cost(self, cost: int, timeout_s: float = 10.0) -> None:
        """Set the pod's deletion cost; the token is read each time (a projected token rotates)."""
        request = urllib.request.Request(
            f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods/{self.pod}",
            data=merge_patch(cost),
            method="PATCH",
            headers={
                "Content-Type": "application/merge-patch+json",
                "Authorization": f"Bearer {(self.account / 'token').read_text().strip()}",
            },
        )
        context = ssl.create_default_context(cafile=str(ca)) if (ca := self.account / "ca.crt").exists() else None
        with urllib.request.urlopen(request, timeout=timeout_s, context=context):
            pass


class CostKeeper:
    """Each `interval_s`: the server's live sequences; the annotation patched when they changed
    (and until a patch succeeds). A server or API that does not answer is logged and retried."""

    def __init__(self, metrics: Callable[[], str], patch: Callable[[int], None], interval_s: float) -> None:
        self._metrics, self._patch, self.interval_s = metrics, patch, interval_s
        self.cost: int | None = None  # the value the annotation holds, once a patch succeeded

    def once(self) -> None:
        try:
            cost = live_sequences(self._metrics())
        except (OSError, ValueError) as exc:
            log.warning("cannot read the server's live sequences: %s", exc)
            return
        if cost == self.cost:
            return
        try:
            self._patch(cost)
        except OSError as exc:  # an HTTP error or a refused connection (URLError) among them
            log.warning("cannot set %s to %d: %s", ANNOTATION, cost, exc)
            return
        log.info("%s: %d (live sequences)", ANNOTATION, cost)
        self.cost = cost

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.once()
            stop.wait(self.interval_s)


def pod_name(environ: Mapping[str, str]) -> str:
    """This pod's name: MHA_POD_NAME (the Downward API's metadata.name), else the host name."""
    return environ.get("MHA_POD_NAME") or os.uname().nodename
