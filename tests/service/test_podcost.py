"""`mha pod-cost`: the live sequences read from a real server's /metrics, the pod patched as the
API server expects (a stand-in records the request: no API server runs here), only on change."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import grpc
import numpy as np
import pytest

from service.client.podcost import ANNOTATION, CostKeeper, PodApi, live_sequences, merge_patch, read_metrics
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from tests.support import ServerThread, make_settings

ROOT = Path(__file__).resolve().parents[2]


def test_live_sequences_are_read_from_a_real_servers_metrics(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir, metrics_port=0)) as server:
        metrics = f"127.0.0.1:{server.metrics_port}"
        assert live_sequences(read_metrics(metrics)) == 0
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for sequence_id in (7, 8):  # two sequences started, neither ended
                request = encode_infer_request(np.ones((1, 2, 32), np.float32))
                request.parameters["sequence_id"].int64_param = sequence_id
                request.parameters["sequence_start"].bool_param = True
                stub.ModelInfer(request, timeout=30)
        assert live_sequences(read_metrics(metrics)) == 2


def test_the_workers_live_sequences_add_up() -> None:
    text = 'mha_sequences_active{worker="0"} 2.0\nmha_sequences_active{worker="1"} 3.0\nmha_other 9.0\n'
    assert live_sequences(text) == 5


class ApiStandIn(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str, dict[str, str], bytes]]] = []
    status: ClassVar[int] = 200

    def do_PATCH(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        ApiStandIn.seen.append((self.command, self.path, dict(self.headers), body))
        self.send_response(ApiStandIn.status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api(tmp_path: Path) -> Iterator[PodApi]:
    ApiStandIn.seen, ApiStandIn.status = [], 200
    server = HTTPServer(("127.0.0.1", 0), ApiStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    (tmp_path / "namespace").write_text("serving\n")
    (tmp_path / "token").write_text("first-token\n")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.server_port)}
    in_cluster = PodApi.in_cluster("mha-serve-abc", env, account=tmp_path)
    yield PodApi(in_cluster.api_url.replace("https", "http"), in_cluster.namespace, in_cluster.pod, tmp_path)
    server.shutdown()


def test_the_pod_is_patched_with_a_merge_patch_and_a_fresh_token(api: PodApi) -> None:
    api.patch_cost(3)
    (api.account / "token").write_text("rotated-token")  # projected tokens rotate: read every time
    api.patch_cost(0)
    (method, path, headers, body), second = ApiStandIn.seen
    assert method == "PATCH" and path == "/api/v1/namespaces/serving/pods/mha-serve-abc"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert headers["Authorization"] == "Bearer first-token" and second[2]["Authorization"] == "Bearer rotated-token"
    assert json.loads(body) == {"metadata": {"annotations": {ANNOTATION: "3"}}}
    assert second[3] == merge_patch(0)


def test_the_cost_is_patched_only_when_it_changed_and_until_a_patch_succeeds(api: PodApi) -> None:
    counts = iter([1, 1, 2, 2, 2, 0])
    keeper = CostKeeper(lambda: f"mha_sequences_active {next(counts)}\n", api.patch_cost, 5.0)
    keeper.once()  # 1: patched
    keeper.once()  # 1: unchanged
    ApiStandIn.status = 403  # the role missing: logged, and tried again next time
    keeper.once()
    assert keeper.cost == 1
    ApiStandIn.status = 200
    keeper.once()  # 2, after the refusal: patched
    keeper.once()  # 2: unchanged
    keeper.once()  # 0: patched
    assert [json.loads(body)["metadata"]["annotations"][ANNOTATION] for *_, body in ApiStandIn.seen] == [
        "1",
        "2",
        "2",
        "0",
    ]
    assert keeper.cost == 0


def test_a_server_that_does_not_answer_patches_nothing(api: PodApi) -> None:
    def unreachable() -> str:
        raise ConnectionRefusedError("connection refused")

    keeper = CostKeeper(unreachable, api.patch_cost, 5.0)
    keeper.once()
    assert ApiStandIn.seen == [] and keeper.cost is None


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        ([], 1, "not in a Kubernetes pod with a service account token"),
        (["--interval-s", "0"], 2, "--interval-s 0: expected a positive, finite number of seconds"),
    ],
)
def test_misuse_says_so_in_one_line(args: list[str], code: int, says: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "pod-cost", *args], capture_output=True, text=True, timeout=60, env=env
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code and len(lines) == 1, lines
    assert says in lines[0]
