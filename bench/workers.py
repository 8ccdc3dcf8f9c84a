"""Throughput against --workers, clients on separate connections, side by side in one run.

Each client is a thread with its own channel, so the kernel spreads connections over the
workers. Run it where cores allow: scaling needs cores beyond the clients' own (the goal is
at least 0.7 x N times one worker's req/s for N up to the cores left to the server).
Writes bench/results/workers.json. Not a test.

usage: python bench/workers.py [--workers 1,2] [--clients 16] [--seconds 5] [--model-dir models/default]
"""

from __future__ import annotations

import logging
import os
import sys

import common

from service.app.launch import ServerProcess
from service.client.loadgen import run_load

log = logging.getLogger("bench")


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        server = ServerProcess(["--model-dir", str(args.model_dir), "--workers", str(workers), "--threads", "1"])
        try:
            server.start(common.RESULTS / f"workers-{workers}.log")
            run_load(server.url, args.clients, 1.0, [args.seq_len])  # warm-up
            result = run_load(server.url, args.clients, args.seconds, [args.seq_len])
        finally:
            server.terminate(timeout=60)
        rows.append({"workers": workers, "rps": round(result.throughput_rps, 1), "p50_ms": round(result.p50_ms, 3)})
        rows[-1]["vs_one_worker"] = round(rows[-1]["rps"] / rows[0]["rps"], 2)
        log.info("%s", rows[-1])
    common.write_json("workers.json", {"cores": os.cpu_count(), "clients": args.clients, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
