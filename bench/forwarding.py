"""A decode step handed to its owner worker against one computed where it lands, side by side.

`mha serve --workers 2`, one client channel (so one worker receives every step), two sequences:
one owned by the receiving worker (local), one owned by the other (forwarded over the workers'
Unix socket). One-token steps alternate between them (local, forwarded, local, ...), so both see
the same machine state; the ratio of their medians is the cost of forwarding. Which sequence is
local is found from the workers' own /metrics (ForwardedStep counts), not assumed.
Writes bench/results/forwarding.json. Not a test.

usage: python bench/forwarding.py [--steps 400] [--model-dir models/default]
"""

from __future__ import annotations

import logging
import re
import statistics
import sys
import time
import urllib.request

import common
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.app.launch import ServerProcess
from service.client.client import MHAClient
from service.protocol.peers import FORWARDED_METHOD, owner_of

log = logging.getLogger("bench")
STARTED = re.compile(r"worker (\d+) started \(pid \d+, metrics 127\.0\.0\.1:(\d+)\)")


def forwarded_count(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(
            s.value
            for f in families
            for s in f.samples
            if s.name == "mha_requests_total" and s.labels.get("method") == FORWARDED_METHOD
        )


def ids_by_owner() -> dict[int, str]:
    found: dict[int, str] = {}
    n = 0
    while len(found) < 2:
        found.setdefault(owner_of(f"bench-{n}", 2), f"bench-{n}")
        n += 1
    return found


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--model-dir", default="models/default")
    args = parser.parse_args()
    server = ServerProcess(["--model-dir", args.model_dir, "--workers", "2"])
    server.start(common.RESULTS / "forwarding.log")
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
            for _ in range(min(args.steps, 1000)):  # a sequence holds max_seq_len (1024) tokens
                for kind, sequence in kinds.items():
                    x = rng.standard_normal((1, 1, C), dtype=np.float32)
                    started = time.perf_counter()
                    sequence.send(x)
                    times[kind].append(time.perf_counter() - started)
    finally:
        server.terminate(timeout=60)
    p50 = {kind: statistics.median(values[20:]) * 1e3 for kind, values in times.items()}
    result = {
        "steps_each": args.steps,
        "local_p50_ms": round(p50["local"], 3),
        "forwarded_p50_ms": round(p50["forwarded"], 3),
        "forwarded_over_local": round(p50["forwarded"] / p50["local"], 3),
    }
    log.info("%s", result)
    common.write_json("forwarding.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
