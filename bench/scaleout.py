"""Scaling out, in one run: a forwarded decode step against a local one (--workers 2), and how
a real L7 balancer (nginx, deploy/nginx/mha-serve.conf) spreads one channel over 3 replicas.

Forwarding: a decode step handed to its owner worker against one computed where it lands.

`mha serve --workers 2`, one client channel (so one worker receives every step), two sequences:
one started on that channel (so owned by the receiving worker: local), one started on a
connection of its own that reached the other worker (forwarded over the workers' Unix socket).
One-token steps alternate between them (local, forwarded, local, ...), so both see the same
machine state; the ratio of their medians is the cost of forwarding. Where each sequence lives is
what the server says with each step, not assumed.
Spread: one gRPC channel to nginx in front of 3 replicas sends stateless requests (each
replica's share, from its own /metrics), then 8 sequences of 24 steps, each step on a new
channel (how many replicas each sequence touched: 1 is right).
Writes bench/results/scaleout.json. Not a test.

usage: python bench/scaleout.py [--steps 400] [--requests 300] [--model-dir models/default]
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np

from service.app.launch import ServerProcess
from service.client.client import ClientSequence, MHAClient
from service.client.loadgen import requests_answered

log = logging.getLogger("bench")


def started_elsewhere(url: str, here: int, x: np.ndarray) -> str:
    """A sequence started on a connection of its own that reached a worker other than `here`."""
    for n in range(64):
        with MHAClient(url, own_connection=True) as own:
            if own.step(f"bench-{n}", x, offset=0, start=True).worker != here:
                return f"bench-{n}"
    raise RuntimeError("64 new connections all reached one worker")


def forwarding(model_dir: str, steps: int) -> dict[str, float]:
    server = ServerProcess(["--model-dir", model_dir, "--workers", "2"])
    server.start(common.RESULTS / "scaleout-workers.log")
    try:
        time.sleep(5)  # both workers loaded
        with MHAClient(server.url) as client:
            C = int(client.model_metadata().inputs[0].shape[-1])
            rng = np.random.default_rng(0)
            local = client.sequence("bench-local")
            local.send(rng.standard_normal((1, 1, C), dtype=np.float32))  # started here: owned by this channel's worker
            forwarded = client.sequence(started_elsewhere(server.url, local.worker, np.zeros((1, 1, C), np.float32)))
            forwarded.tokens, forwarded.length = [np.zeros((1, 1, C), np.float32)], 1
            kinds = {"local": local, "forwarded": forwarded}
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
        balancer = common.Balancer(common.NGINX, run_dir, replicas).start()
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
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    model_dir = str(args.model_dir)
    result = {"forwarding": forwarding(model_dir, args.steps), "balancer": spread(model_dir, args.requests)}
    log.info("%s", result)
    common.write_json("scaleout.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
