"""Scaling out, in one run: a forwarded decode step against a local one (--workers 2), and how
a real L7 balancer (nginx, deploy/nginx/mha-serve.conf) spreads one channel over 3 replicas.

Forwarding: a decode step handed to its owner worker against one computed where it lands.

`mha serve --workers 2`, one client channel (so one worker receives every step), two sequences:
one owned by the receiving worker (local), one owned by the other (forwarded over the workers'
Unix socket). One-token steps alternate between them (local, forwarded, local, ...), so both see
the same machine state; the ratio of their medians is the cost of forwarding. Which sequence is
local is found from the workers' own /metrics (HandedOver counts), not assumed.
Spread: one gRPC channel to nginx in front of 3 replicas sends stateless requests (each
replica's share, from its own /metrics), then 8 sequences of 24 steps, each step on a new
channel (how many replicas each sequence touched: 1 is right).
Writes bench/results/scaleout.json. Not a test.

usage: python bench/scaleout.py [--steps 400] [--requests 300] [--model-dir models/default]
"""

from __future__ import annotations

import logging
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np

from service.app.launch import Balancer, ServerProcess
from service.client.client import ClientSequence, MHAClient
from service.client.loadgen import requests_answered
from service.protocol.peers import FORWARDED_METHOD, owner_of

log = logging.getLogger("bench")
NGINX = Path(__file__).resolve().parent.parent / ".tools" / "nginx" / "usr" / "sbin" / "nginx"  # make install
STARTED = re.compile(r"worker (\d+) started \(pid \d+, metrics 127\.0\.0\.1:(\d+)\)")


def forwarded_count(port: int) -> float:
    return requests_answered(f"127.0.0.1:{port}", FORWARDED_METHOD)


def ids_by_owner() -> dict[int, str]:
    found: dict[int, str] = {}
    n = 0
    while len(found) < 2:
        found.setdefault(owner_of(f"bench-{n}", 2), f"bench-{n}")
        n += 1
    return found


def forwarding(model_dir: str, steps: int) -> dict[str, float]:
    server = ServerProcess(["--model-dir", model_dir, "--workers", "2"])
    server.start(common.RESULTS / "scaleout-workers.log")
    try:
        time.sleep(5)  # both workers loaded
        ports = {int(i): int(p) for i, p in STARTED.findall(server.log())}
        with MHAClient(server.url) as client:
            C = int(client.model_metadata().inputs[0].shape[-1])
            rng = np.random.default_rng(0)
            ids = ids_by_owner()
            sequences = {owner: client.sequence(ids[owner]) for owner in ids}
            before = {w: forwarded_count(p) for w, p in ports.items()}
            sequences[0].send(rng.standard_normal((1, 1, C), dtype=np.float32))
            after = {w: forwarded_count(p) for w, p in ports.items()}
            local_owner = 1 if after[0] > before[0] else 0  # worker 0 counted a hand-over: this channel is on 1
            kinds = {"local": sequences[local_owner], "forwarded": sequences[1 - local_owner]}
            times: dict[str, list[float]] = {"local": [], "forwarded": []}
            for _ in range(min(steps, 1000)):  # a sequence holds max_seq_len (1024) tokens
                for kind, sequence in kinds.items():
                    x = rng.standard_normal((1, 1, C), dtype=np.float32)
                    started = time.perf_counter()
                    sequence.send(x)
                    times[kind].append(time.perf_counter() - started)
    finally:
        server.terminate(timeout=60)
    p50 = {kind: statistics.median(values[20:]) * 1e3 for kind, values in times.items()}
    return {
        "steps_each": steps,
        "local_p50_ms": round(p50["local"], 3),
        "forwarded_p50_ms": round(p50["forwarded"], 3),
        "forwarded_over_local": round(p50["forwarded"] / p50["local"], 3),
    }


def spread(model_dir: str, requests: int) -> dict[str, object]:
    replicas = [ServerProcess(["--model-dir", model_dir, "--replica-name", f"r{i}"]) for i in range(3)]
    run_dir = Path(tempfile.mkdtemp(prefix="mha-nginx-"))
    try:
        for i, replica in enumerate(replicas):
            replica.start(common.RESULTS / f"scaleout-r{i}.log")
        balancer = Balancer(NGINX, run_dir, replicas).start()
        try:
            with MHAClient(balancer.url) as client:
                C = int(client.model_metadata().inputs[0].shape[-1])
                x = np.ones((1, 64, C), np.float32)
                for _ in range(requests):
                    client.infer(x)
            shares = [requests_answered(f"127.0.0.1:{r.metrics_port}") / requests for r in replicas]
            touched = []
            rng = np.random.default_rng(1)
            for n in range(8):
                sequence = ClientSequence(MHAClient(balancer.url), f"spread-{n}")
                homes = set()
                for _ in range(24):
                    sequence.client.close()
                    sequence.client = MHAClient(balancer.url)  # a new channel each step
                    sequence.send(rng.standard_normal((1, 1, C), dtype=np.float32))
                    homes.add(sequence.replica)
                sequence.client.close()
                touched.append(len(homes))
        finally:
            balancer.stop()
    finally:
        for replica in replicas:
            replica.terminate(timeout=60)
    return {
        "requests_on_one_channel": requests,
        "share_per_replica": [round(s, 3) for s in shares],
        "replicas_per_sequence": touched,
    }


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--model-dir", default="models/default")
    args = parser.parse_args()
    result = {"forwarding": forwarding(args.model_dir, args.steps), "balancer": spread(args.model_dir, args.requests)}
    log.info("%s", result)
    common.write_json("scaleout.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
