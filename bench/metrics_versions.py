"""What a server's own metrics cost as it serves version after version: the service's real
Metrics, `--versions` versions loaded one after the other (each counted a request and a batch,
then unloaded, a scrape every 10 updates, the grace 0), read through what /metrics serves with the
registry forgetting each version gone (the server's way) and keeping it (before). Each mode runs
in a process of its own, the modes alternating `--runs` times: the best read time of 5 at each
checkpoint, the samples the registry holds, and the process's peak RSS. Writes
bench/results/metrics_versions.json. Not a test.

usage: python bench/metrics_versions.py [--versions 1000] [--runs 3]
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time

import common
from prometheus_client import CollectorRegistry, generate_latest

from service.batching import BatchEvent
from service.metrics import Metrics, served_registry

log = logging.getLogger("bench")
MODES = ("forget", "keep")


def labels(version: int) -> dict[str, str]:
    model = {"name": "mha", "version": str(version), "d_model": "128", "n_head": "8", "max_seq_len": "1024"}
    return {**model, "causal": "true", "weights_sha256": "0" * 64, "verified": "true"}


def measure(mode: str, versions: int) -> dict[str, object]:
    """One mode in this process: {checkpoint: (best read ms, registry samples)}, and the peak RSS."""
    registry = CollectorRegistry(auto_describe=False)
    metrics = Metrics(registry)
    served = served_registry(registry, 0, metrics.forget if mode == "forget" else None)
    checkpoints, rows = {1, versions // 10, versions}, {}
    for version in range(versions):
        metrics.versions.loaded(labels(version))
        metrics.triton.loaded(["mha", "mha_sequence"], str(version))
        metrics.triton.requests("mha", str(version), [0.001], [])
        metrics.requests.observe_answers("mha", str(version), 64, [0.001])
        metrics.requests.observe_batches([(BatchEvent(1, 1, (64,), 0, 0.001, 0.001, "ort-cpu"), "mha", str(version))])
        if version:
            metrics.versions.unloaded(labels(version - 1))
        if version % 10 == 0:
            generate_latest(served)  # a scrape every 10 updates
        if version + 1 in checkpoints:
            times = []
            for _ in range(5):
                start = time.perf_counter()
                generate_latest(served)
                times.append(time.perf_counter() - start)
            held = sum(len(family.samples) for family in registry.collect())
            rows[str(version + 1)] = {"read_ms": round(min(times) * 1e3, 2), "registry_samples": held}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "rows": rows, "peak_rss_mib": round(peak_mib, 1)}


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--versions", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", choices=MODES, help="measure one mode in this process, print it as JSON")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.versions)))
        return
    runs = []
    for run in range(args.runs):
        for mode in MODES if run % 2 == 0 else MODES[::-1]:
            command = [sys.executable, __file__, "--one", mode, "--versions", str(args.versions)]
            runs.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
            log.info("%s: %s, peak RSS %.1f MiB", mode, runs[-1]["rows"], runs[-1]["peak_rss_mib"])
    common.write_json("metrics_versions.json", {"versions": args.versions, "runs": runs})


if __name__ == "__main__":
    main()
