"""Where a server's CPU goes under load, thread by thread: CPU microseconds and context switches
per request of every thread of every process of the server, while closed-loop clients send
(1, 64, 128) requests. Servers as bench/compare.py starts them, visited in turn for `--rounds`
rounds; per thread, the medians over the rounds.

Timing says how much slower a server is under load; this says which thread pays: the event loop
(protocol, call scope, batching), the compute thread, PyTorch's and ORT's pools, gRPC's
event-engine threads (docs/benchmarks.md). Writes bench/results/threads_under_load.json.
Not a test.

usage: python bench/threads_under_load.py [--clients 8,32] [--seconds 4] [--rounds 3]
                                          [--servers "mha-serve,Triton + ORT,floor: no compute"]
"""

from __future__ import annotations

import logging
import os
import statistics
from pathlib import Path

import common
import compare

from service.client.loadgen import run_load

log = logging.getLogger("bench")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
Counts = dict[str, tuple[float, int, int]]  # "pid/tid name" -> (CPU seconds, voluntary, involuntary switches)


def threads(pgid: int) -> Counts:
    """Every thread of every live process in process group `pgid`."""
    found: Counts = {}
    for pid, _ in common.group_stats(pgid):
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
                name = (task / "comm").read_text().strip()
            except OSError:  # a thread that ended meanwhile
                continue
            switches = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if "ctxt" in line}
            cpu = (int(fields[11]) + int(fields[12])) * TICK_S
            found[f"{pid}/{task.name} {name}"] = (
                cpu,
                switches["voluntary_ctxt_switches"],
                switches["nonvoluntary_ctxt_switches"],
            )
    return found


def visit(server: compare.Started, clients: int, seconds: float) -> dict[str, list[float]]:
    """One visit: per thread, [CPU µs, voluntary, involuntary switches] per request."""
    before = threads(server.proc.pid)
    result = run_load(server.url, clients, seconds, [64])
    after = threads(server.proc.pid)
    n = max(result.requests, 1)
    per: dict[str, list[float]] = {}
    for key, (cpu, vol, invol) in after.items():
        b = before.get(key, (0.0, 0, 0))
        per[key] = [(cpu - b[0]) * 1e6 / n, (vol - b[1]) / n, (invol - b[2]) / n]
    return per


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", type=compare.server_list, default=("mha-serve", "floor: no compute"))
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    started = []
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        for name in args.servers:
            server = compare.Started(name, args.model_dir, None)
            started.append(server)
            server.ready()
            run_load(server.url, 8, 1.0, [64])  # warm-up
        for clients in (int(c) for c in args.clients.split(",")):
            visits: dict[str, list[dict[str, list[float]]]] = {s.name: [] for s in started}
            for r in range(args.rounds):
                for server in started if r % 2 == 0 else reversed(started):
                    visits[server.name].append(visit(server, clients, args.seconds))
            for name, rounds in visits.items():
                keys = set.intersection(*(set(v) for v in rounds))
                medians = {k: [round(statistics.median(v[k][i] for v in rounds), 2) for i in range(3)] for k in keys}
                busy = {k: v for k, v in sorted(medians.items(), key=lambda kv: -kv[1][0]) if v[0] >= 1.0}
                total = [round(sum(v[i] for v in medians.values()), 2) for i in range(3)]
                results.setdefault(name, {})[f"{clients} clients"] = {"all threads": total, **busy}
                log.info("%s, %d clients: %s", name, clients, results[name][f"{clients} clients"])
    finally:
        for server in started:
            server.stop()
    path = common.write_json(
        "threads_under_load.json", {"columns": ["cpu_us", "voluntary", "involuntary"], "servers": results}
    )
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
