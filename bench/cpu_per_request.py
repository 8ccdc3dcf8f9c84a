"""Server CPU time per request with idle threads spinning or sleeping, side by side in one run.

For each CPU backend and each setting of --thread-spinning, a real `mha serve` process serves
closed-loop (1, 64, 128) load at 1 and 8 clients; the server's own CPU time over the run (its
process_cpu_seconds_total, what `mha bench` reads too) divided by the requests it answered is
the CPU a request costs. Client and server share this machine, so req/s and latency are
reported beside it. Writes
bench/results/cpu_per_request.json. Not a test.

usage: python bench/cpu_per_request.py [--seconds 5] [--model-dir models/default]
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import common

from service.app.launch import ServerProcess
from service.client.loadgen import run_load, server_cpu_seconds

log = logging.getLogger("bench")
CLIENTS = (1, 8)


def measure(model_dir: str, backend: str, spinning: bool, seconds: float, logs: Path) -> list[dict[str, object]]:
    args = ["--model-dir", model_dir, "--backend", backend, "--thread-spinning", str(spinning).lower()]
    server = ServerProcess(args)
    server.env.pop("OMP_WAIT_POLICY", None)  # the setting alone decides
    rows = []
    try:
        server.start(logs / f"cpu-{backend}-{spinning}.log")
        run_load(server.url, 1, 1.0, [64])  # warm-up
        for clients in CLIENTS:
            metrics = f"127.0.0.1:{server.metrics_port}"
            before = server_cpu_seconds(metrics)
            result = run_load(server.url, clients, seconds, [64])
            after = server_cpu_seconds(metrics)
            assert before is not None and after is not None, "the server's /metrics could not be read"
            cpu = after - before
            rows.append(
                {
                    "backend": backend,
                    "spinning": spinning,
                    "clients": clients,
                    "requests": result.requests,
                    "rps": round(result.throughput_rps, 1),
                    "p50_ms": round(result.p50_ms, 3),
                    "cpu_ms_per_request": round(cpu / max(result.requests, 1) * 1e3, 3),
                }
            )
            log.info("%s", rows[-1])
    finally:
        server.terminate()
    return rows


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    rows = []
    for backend in ("ort-cpu", "torch"):
        for spinning in (True, False):
            rows += measure(str(args.model_dir), backend, spinning, args.seconds, common.RESULTS)
    common.write_json("cpu_per_request.json", {"cores": os.cpu_count(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
