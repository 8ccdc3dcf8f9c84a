"""What clients that never read cost the server: its resident memory (VmRSS) and the work it does
for nobody, and what well-behaved clients beside them get.

Case 1: one ModelStreamInfer stream sends 3,000 requests of (2, 512, 128) and reads nothing for
`--hold-s`, then cancels. Case 2: 40 HTTP clients each post a (2, 512, 128) request and never
read the answer, while one gRPC client sends (1, 64, 128) requests; they then leave. For each:
RSS before, at its peak while the clients hold on, and `--settle-s` after they leave; the
requests computed (mha_tokens_total / tokens per request) and refused (RESOURCE_EXHAUSTED); the
well-behaved client's p50 and its errors. Case 2 runs again with --max-inflight-mb 64.
Writes bench/results/memory_abuse.json. Not a test.

usage: python bench/memory_abuse.py [--model-dir models/default] [--hold-s 15] [--settle-s 5]
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable

import common
import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.app.launch import ServerProcess
from service.client.client import InferenceError, MHAClient
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request

log = logging.getLogger("bench")
SHAPE = (2, 512, 128)
TOKENS = SHAPE[0] * SHAPE[1]


def metric(port: int, name: str, labels: dict[str, str] | None = None) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = (s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
    return sum(s.value for s in samples if (labels or {}).items() <= s.labels.items())


class Watch:
    """The server's peak RSS, sampled every 50 ms while a case runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, common.rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def polite(url: str, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    """The well-behaved client: (1, 64, 128) requests one after another."""
    x = np.ones((1, 64, 128), np.float32)
    with MHAClient(url) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                client.infer(x, timeout=10)
                latencies.append((time.perf_counter() - start) * 1e3)
            except InferenceError as exc:
                errors.append(exc.code.name)


def never_reading_stream(server: ServerProcess, hold_s: float) -> Callable[[], None]:
    x = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    requests = (encode_infer_request(x, request_id=str(i)) for i in range(3000))
    channel = grpc.insecure_channel(server.url)
    call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests, timeout=600)
    time.sleep(hold_s)  # nothing read

    def leave() -> None:
        call.cancel()
        channel.close()

    return leave


def never_reading_http(server: ServerProcess, hold_s: float, clients: int = 40) -> Callable[[], None]:
    x = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    tensor = {"name": "x", "datatype": "FP32", "shape": list(SHAPE), "data": x.ravel().tolist()}
    body = json.dumps({"inputs": [tensor]}).encode()
    head = f"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    sockets = []
    for _ in range(clients):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.http_port))
        s.sendall(head + body)  # and never reads
        sockets.append(s)
    time.sleep(hold_s)

    def leave() -> None:
        for s in sockets:
            s.close()

    return leave


def case(
    server: ServerProcess, abuse: Callable[[ServerProcess, float], Callable[[], None]], hold_s: float, settle_s: float
) -> dict[str, float]:
    assert server.proc is not None, "the server is started first"
    pid = server.proc.pid
    time.sleep(1.0)
    before, tokens = common.rss_mib(pid), metric(server.metrics_port, "mha_tokens_total")
    latencies: list[float] = []
    errors: list[str] = []
    stop = threading.Event()
    calm: list[float] = []
    warm = threading.Thread(target=polite, args=(server.url, stop, calm, errors))
    warm.start()
    time.sleep(2.0)
    stop.set()
    warm.join()
    stop = threading.Event()
    beside = threading.Thread(target=polite, args=(server.url, stop, latencies, errors))
    watch = Watch(pid)
    beside.start()
    leave = abuse(server, hold_s)
    stop.set()
    beside.join()  # the polite client's tokens are all counted now, and no more come
    held = metric(server.metrics_port, "mha_inflight_bytes") / 2**20
    refused = metric(server.metrics_port, "mha_requests_total", {"code": "RESOURCE_EXHAUSTED"})
    abusive_tokens = metric(server.metrics_port, "mha_tokens_total") - tokens - 64 * (len(latencies) + len(calm))
    leave()
    time.sleep(settle_s)
    return {
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(watch.stop(), 1),
        "rss_after_mb": round(common.rss_mib(pid), 1),
        "inflight_mb_while_held": round(held, 1),
        "refused_resource_exhausted": refused,
        "abusive_requests_computed": round(max(0.0, abusive_tokens) / TOKENS, 1),
        "polite_p50_ms_alone": round(statistics.median(calm), 3) if calm else float("nan"),
        "polite_p50_ms_beside": round(statistics.median(latencies), 3) if latencies else float("nan"),
        "polite_errors": len(errors),
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--hold-s", type=float, default=15.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    args = parser.parse_args()
    results = {}
    cases: tuple[tuple[str, Callable[[ServerProcess, float], Callable[[], None]], list[str]], ...] = (
        ("stream_3000_never_read", never_reading_stream, []),
        ("http_40_never_read", never_reading_http, []),
        ("http_40_never_read_budget_64mb", never_reading_http, ["--max-inflight-mb", "64"]),
    )
    for name, abuse, flags in cases:
        server = ServerProcess(["--model-dir", str(args.model_dir), *flags])
        server.start(common.RESULTS / f"memory_abuse_{name}.log")
        try:
            results[name] = case(server, abuse, args.hold_s, args.settle_s)
        finally:
            server.terminate()
        log.info("%s: %s", name, results[name])
    log.info("wrote %s", common.write_json("memory_abuse.json", results))


if __name__ == "__main__":
    main()
