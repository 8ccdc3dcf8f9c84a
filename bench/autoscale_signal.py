"""Which signal should scale replicas: queue time over compute time, or in-flight requests per
replica? Both measured against one server as load rises, beside the latency clients see.

One `mha serve` (default settings), closed-loop (1, 64, 128) load from `mha bench`'s load
generator at 1, 2, 4, 8, 16 and 32 clients, `--seconds` each. From the server's own /metrics over
each level: queue time over compute time (a request's mean wait for its batch, over a batch's
mean compute time: what the KEDA query computes with rate()), and the mean of
mha_inflight_requests sampled 10 times a second. A good scaling signal stays near zero while
a replica keeps up and grows with the latency clients pay once it does not; a signal that
grows with load the replica absorbs (batching) scales out for nothing.
Writes bench/results/autoscale_signal.json. Not a test.

usage: python bench/autoscale_signal.py [--seconds 4] [--model-dir models/default]
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import urllib.request

import common
from prometheus_client.parser import text_string_to_metric_families

from service.app.launch import ServerProcess
from service.client.loadgen import run_load

log = logging.getLogger("bench")
LEVELS = (1, 2, 4, 8, 16, 32)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = {
        "mha_queue_duration_seconds_sum",
        "mha_queue_duration_seconds_count",
        "mha_inference_duration_seconds_sum",
        "mha_inference_duration_seconds_count",
        "mha_inflight_requests",
    }
    found = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name] += sample.value
    return found


def level(server: ServerProcess, clients: int, seconds: float) -> dict[str, float]:
    inflight: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            inflight.append(scrape(server.metrics_port)["mha_inflight_requests"])
            time.sleep(0.1)

    before = scrape(server.metrics_port)
    sampler = threading.Thread(target=sample)
    sampler.start()
    result = run_load(server.url, clients, seconds, [64])
    stop.set()
    sampler.join()
    after = scrape(server.metrics_port)

    def mean(name: str) -> float:
        count = after[f"{name}_count"] - before[f"{name}_count"]
        return (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else 0.0

    queue, compute = mean("mha_queue_duration_seconds"), mean("mha_inference_duration_seconds")
    return {
        "clients": clients,
        "rps": round(result.throughput_rps, 1),
        "p50_ms": round(result.p50_ms, 3),
        "p99_ms": round(result.p99_ms, 3),
        "queue_ms": round(queue * 1e3, 3),
        "compute_ms": round(compute * 1e3, 3),
        "queue_over_compute": round(queue / compute, 3) if compute else 0.0,
        "inflight_mean": round(sum(inflight) / max(len(inflight), 1), 2),
    }


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    server = ServerProcess(["--model-dir", str(args.model_dir)])
    rows = []
    try:
        server.start(common.RESULTS / "autoscale-signal.log")
        run_load(server.url, 2, 1.0, [64])  # warm-up
        for clients in LEVELS:
            rows.append(level(server, clients, args.seconds))
            log.info("%s", rows[-1])
    finally:
        server.terminate()
    common.write_json("autoscale_signal.json", {"levels": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
