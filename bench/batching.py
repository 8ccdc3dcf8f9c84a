"""Dynamic batching on and off, side by side in one run: throughput and p50/p99 latency.

Starts `mha serve` twice as child processes on 127.0.0.1 (--max-batch-size 16 and 1) on the
default model, drives each with concurrency 1, 8 and 32 for a fixed time per cell, for
(1, 64, 128) requests and for mixed T. Writes bench/results/batching.json. Not a test.

usage: python bench/batching.py [--seconds 4] [--model-dir models/default] [--backend auto]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Any

import common

from service.app.launch import ServerProcess
from service.client.loadgen import run_load

log = logging.getLogger("bench")
CONCURRENCY = (1, 8, 32)
MIXED_T = (16, 48, 64, 100, 128, 200, 256)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    logs = Path("bench/results")
    logs.mkdir(parents=True, exist_ok=True)
    for label, batch in (("on", "16"), ("off", "1")):
        server = ServerProcess(
            [
                "--model-dir",
                str(args.model_dir),
                "--backend",
                args.backend,
                "--max-batch-size",
                batch,
                "--max-queue-delay-ms",
                "2",
            ]
        )
        server.start(logs / f"batching-server-{label}.log")
        try:
            for workload in ("fixed", "mixed"):
                for concurrency in CONCURRENCY:
                    seqs = (64,) if workload == "fixed" else MIXED_T
                    result = run_load(server.url, concurrency, args.seconds, seqs)
                    row = {"batching": label, "workload": workload, "concurrency": concurrency, **result.to_dict()}
                    log.info(
                        "batching %-3s %-5s c=%-2d  %7.1f req/s  p50 %7.2f ms  p99 %7.2f ms  errors %d",
                        label,
                        workload,
                        concurrency,
                        result.throughput_rps,
                        result.p50_ms,
                        result.p99_ms,
                        sum(result.errors.values()),
                    )
                    rows.append(row)
        finally:
            server.terminate()
    ratios = []
    for workload in ("fixed", "mixed"):
        for concurrency in CONCURRENCY:
            on = next(
                r
                for r in rows
                if r["batching"] == "on" and r["workload"] == workload and r["concurrency"] == concurrency
            )
            off = next(
                r
                for r in rows
                if r["batching"] == "off" and r["workload"] == workload and r["concurrency"] == concurrency
            )
            ratios.append(
                {
                    "workload": workload,
                    "concurrency": concurrency,
                    "throughput_on_over_off": on["throughput_rps"] / off["throughput_rps"],
                    "p99_on_over_off": on["p99_ms"] / off["p99_ms"],
                }
            )
            log.info(
                "%-5s c=%-2d  throughput on/off %.2fx  p99 on/off %.2fx",
                workload,
                concurrency,
                ratios[-1]["throughput_on_over_off"],
                ratios[-1]["p99_on_over_off"],
            )
    meta = {
        "machine": platform.machine(),
        "seconds_per_cell": args.seconds,
        "backend": args.backend,
        "shape": "(1, T, 128)",
        "mixed_T": MIXED_T,
    }
    (logs / "batching.json").write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=2) + "\n")
    log.info("wrote %s", logs / "batching.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
