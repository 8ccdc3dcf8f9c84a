"""Where a lone client's request spends the server's CPU: mha-serve beside the in-line floor, by library.

Each server is started as bench/compare.py starts it and sampled with Linux `perf record` (999 Hz,
its whole process) while one closed-loop client sends (1, 64, 128) requests; the servers are
visited in turn for `--rounds` rounds, so that a spell of the machine falls on all of them. The
samples of the event loop's thread (the process's main thread: it decodes, checks, computes a
lone request with ORT's pool, encodes and keeps the books) are grouped by the library they fell
in and reported as microseconds per request; the other threads (ORT's pool, gRPC's poller and
event engine) as one sum. Timing alone says how much slower a server is; this says in which
library the difference lies (docs/benchmarks.md).

Needs `perf` (Debian's linux-perf) and permission to sample the servers. Not a test.
Writes bench/results/attribution.json and prints a table.

usage: python bench/attribution.py [--seconds 3] [--rounds 3] [--servers "mha-serve,floor: ORT in-line"]
                                   [--model-dir models/default]
"""

from __future__ import annotations

import collections
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import common
import compare

from service.client.loadgen import run_load

log = logging.getLogger("bench")
FREQUENCY_HZ = 999
SERVERS = ("mha-serve", "floor: ORT in-line")
GROUPS = (  # (what a sample's library path holds, the group it is counted in), first match wins
    ("libpython", "Python interpreter"),
    ("onnxruntime", "ONNX Runtime"),
    ("cygrpc", "gRPC core"),
    ("kernel", "kernel"),
    ("_message", "protobuf"),
    ("_multiarray", "numpy"),
    ("openblas", "numpy"),
    ("libc.so", "C and C++ runtime"),
    ("libstdc++", "C and C++ runtime"),
    ("libm.so", "C and C++ runtime"),
    ("ld-linux", "C and C++ runtime"),
)
# `perf script` default lines: "comm tid time: period event: address symbol (library)"
_SAMPLE = re.compile(r"^\s*\S.*?\s(\d+)\s+\d+\.\d+:\s+\d+\s+\S+:\s+[0-9a-f]+\s.*\(([^()]*)\)\s*$")


def group_of(library: str) -> str:
    for needle, group in GROUPS:
        if needle in library:
            return group
    return "other"


def parse_samples(text: str) -> collections.Counter[tuple[int, str]]:
    """Samples per (thread id, library group) in `perf script` output; lines that are not
    samples (headers, warnings) are skipped."""
    counts: collections.Counter[tuple[int, str]] = collections.Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            counts[(int(match.group(1)), group_of(match.group(2)))] += 1
    return counts


def per_request(counts: collections.Counter[tuple[int, str]], main_tid: int, requests: int) -> dict[str, float]:
    """Microseconds of CPU per request: the main thread's by library group, its total, and the
    other threads' together."""
    us = 1e6 / FREQUENCY_HZ / max(requests, 1)
    main = {group: n * us for (tid, group), n in counts.items() if tid == main_tid}
    others = sum(n for (tid, _), n in counts.items() if tid != main_tid) * us
    table = {group: round(value, 1) for group, value in sorted(main.items(), key=lambda kv: -kv[1])}
    return {**table, "main thread, all": round(sum(main.values()), 1), "other threads": round(others, 1)}


def sample(server: compare.Started, seconds: float) -> tuple[collections.Counter[tuple[int, str]], int, float]:
    """One visit: the samples of `server` while a lone client sends for `seconds`; the requests
    answered, and their p50 in ms."""
    pid = server.proc.pid
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "perf.data"
        record = ["perf", "record", "-q", "-F", str(FREQUENCY_HZ), "-p", str(pid), "-o", str(data)]
        perf = subprocess.Popen([*record, "--", "sleep", str(seconds + 0.5)], stderr=subprocess.DEVNULL)
        result = run_load(server.url, 1, seconds, [64])
        perf.wait()
        text = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True, check=True).stdout
    return parse_samples(text), result.requests, result.p50_ms


@dataclass
class _Tally:
    """What the visits of one server added up to."""

    samples: collections.Counter[tuple[int, str]] = field(default_factory=collections.Counter)
    requests: int = 0
    p50_ms: list[float] = field(default_factory=list)  # one per visit


def measure(names: tuple[str, ...], model_dir: Path, seconds: float, rounds: int) -> dict[str, dict]:
    started: list[compare.Started] = []
    tallies = {name: _Tally() for name in names}
    try:
        for name in names:
            server = compare.Started(name, model_dir, None)
            started.append(server)
            compare.wait_ready(server.url, server.proc)
            run_load(server.url, 1, 1.0, [64])  # warm-up
        for r in range(rounds):
            for server in started if r % 2 == 0 else reversed(started):
                counts, requests, p50 = sample(server, seconds)
                tally = tallies[server.name]
                tally.samples.update(counts)
                tally.requests += requests
                tally.p50_ms.append(p50)
            log.info("round %d of %d done", r + 1, rounds)
        return {
            server.name: {
                "requests": tallies[server.name].requests,
                "p50_ms_per_round": tallies[server.name].p50_ms,
                "cpu_us_per_request": per_request(
                    tallies[server.name].samples, server.proc.pid, tallies[server.name].requests
                ),
            }
            for server in started
        }
    finally:
        for server in started:
            server.stop()


def table(results: dict[str, dict]) -> str:
    names = list(results)
    rows = list(dict.fromkeys(row for r in results.values() for row in r["cpu_us_per_request"]))
    lines = ["| CPU µs per request | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in rows:
        values = [f"{results[n]['cpu_us_per_request'].get(row, 0.0):.1f}" for n in names]
        lines.append(f"| {row} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", type=compare.server_list, default=SERVERS, help=compare.SERVER_HELP)
    parser.add_argument("--model-dir", type=Path, default=Path("models/default"))
    args = parser.parse_args()
    if shutil.which("perf") is None:
        parser.error("needs Linux `perf` on PATH (Debian: apt-get install linux-perf)")
    results = measure(args.servers, args.model_dir.resolve(), args.seconds, args.rounds)
    common.write_json("attribution.json", {"frequency_hz": FREQUENCY_HZ, "servers": results})
    sys.stdout.write(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
