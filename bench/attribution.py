"""Where a lone client's request spends the server's CPU: mha-serve beside a floor, by thread and library.

Each server is started as bench/compare.py starts it and sampled with Linux `perf record` (999 Hz,
every process of it: a server of several workers is a supervisor and its workers) while one
closed-loop client sends (1, 64, 128) requests; the servers are visited in turn for `--rounds`
rounds, so that a spell of the machine falls on all of them. The process whose main thread did
the most is the one the client's connection reached. The samples of its event loop's thread (the
main thread: it decodes, checks, encodes and keeps the books) and of its other threads (the
compute thread, ORT's pool, gRPC's poller and event engine) are each grouped by the library they
fell in and reported as microseconds per request; every other process (the supervisor, the
workers the client did not reach) as one sum. Timing alone says how much slower a server is;
this says in which thread and library the difference lies (docs/benchmarks.md).

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
from collections.abc import Callable, Collection, Sequence
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


OTHER_THREADS = "other threads: "  # a row of the serving process's other threads, by library group
OTHER_PROCESSES = "other processes"


def classify(
    counts: collections.Counter[tuple[int, str]], pids: Sequence[int], tasks: Callable[[int], Collection[int]]
) -> collections.Counter[str]:
    """One visit's samples by row: the serving process's main thread by library group, its other
    threads (`tasks(pid)`: a process's thread ids) by group, and every other process (a
    supervisor, and the workers the client did not reach) as one."""
    serving = serving_process(counts, pids)
    own = tasks(serving)
    rows: collections.Counter[str] = collections.Counter()
    for (tid, group), n in counts.items():
        if tid == serving:  # the main thread's id is its process's
            rows[group] += n
        else:
            rows[OTHER_THREADS + group if tid in own else OTHER_PROCESSES] += n
    return rows


def per_request(rows: collections.Counter[str], requests: int) -> dict[str, float]:
    """Microseconds of CPU per request, each part largest first: the main thread's rows and their
    sum, its process's other threads' rows and their sum, the other processes'."""
    us = 1e6 / FREQUENCY_HZ / max(requests, 1)
    main = [(row, n) for row, n in rows.most_common() if not row.startswith(OTHER_THREADS) and row != OTHER_PROCESSES]
    others = [(row, n) for row, n in rows.most_common() if row.startswith(OTHER_THREADS)]
    table = {row: round(n * us, 1) for row, n in main}
    table["main thread, all"] = round(sum(n for _, n in main) * us, 1)
    table.update({row: round(n * us, 1) for row, n in others})
    table["other threads, all"] = round(sum(n for _, n in others) * us, 1)
    table[OTHER_PROCESSES] = round(rows[OTHER_PROCESSES] * us, 1)
    return table


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it: a server of several workers is a supervisor and its workers."""
    tree, i = [pid], 0
    while i < len(tree):
        children = Path(f"/proc/{tree[i]}/task/{tree[i]}/children")
        tree += [int(child) for child in children.read_text().split()] if children.exists() else []
        i += 1
    return tree


def threads_of(pid: int) -> set[int]:
    """A live process's thread ids."""
    return {int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()}


def serving_process(counts: collections.Counter[tuple[int, str]], pids: Sequence[int]) -> int:
    """The process whose main thread did the most: the worker the lone client's connection reached."""
    main: collections.Counter[int] = collections.Counter()
    for (tid, _), n in counts.items():
        main[tid] += n  # every library group of the thread
    return max(pids, key=lambda pid: main[pid])


def sample(server: compare.Started, seconds: float) -> tuple[collections.Counter[str], int, float]:
    """One visit: the samples of `server`'s processes while a lone client sends for `seconds`,
    by row (`classify`: each visit's client may reach another worker); the requests answered,
    and their p50 in ms."""
    tree = process_tree(server.proc.pid)
    pids = ",".join(str(pid) for pid in tree)
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "perf.data"
        record = ["perf", "record", "-q", "-F", str(FREQUENCY_HZ), "-p", pids, "-o", str(data)]
        perf = subprocess.Popen([*record, "--", "sleep", str(seconds + 0.5)], stderr=subprocess.DEVNULL)
        result = run_load(server.url, 1, seconds, [64])
        perf.wait()
        text = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True, check=True).stdout
    return classify(parse_samples(text), tree, threads_of), result.requests, result.p50_ms


@dataclass
class _Tally:
    """What the visits of one server added up to."""

    rows: collections.Counter[str] = field(default_factory=collections.Counter)
    requests: int = 0
    p50_ms: list[float] = field(default_factory=list)  # one per visit


def measure(names: tuple[str, ...], model_dir: Path, seconds: float, rounds: int) -> dict[str, dict]:
    started: list[compare.Started] = []
    tallies = {name: _Tally() for name in names}
    try:
        for name in names:
            server = compare.Started(name, model_dir, None)
            started.append(server)
            server.ready()
            run_load(server.url, 1, 1.0, [64])  # warm-up
        for r in range(rounds):
            for server in started if r % 2 == 0 else reversed(started):
                rows, requests, p50 = sample(server, seconds)
                tally = tallies[server.name]
                tally.rows.update(rows)
                tally.requests += requests
                tally.p50_ms.append(p50)
            log.info("round %d of %d done", r + 1, rounds)
        return {server.name: _summary(server, tallies[server.name]) for server in started}
    finally:
        for server in started:
            server.stop()


def _summary(server: compare.Started, tally: _Tally) -> dict:
    return {
        "requests": tally.requests,
        "p50_ms_per_round": tally.p50_ms,
        "processes": len(process_tree(server.proc.pid)),
        "cpu_us_per_request": per_request(tally.rows, tally.requests),
    }


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
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    if shutil.which("perf") is None:
        parser.error("needs Linux `perf` on PATH (Debian: apt-get install linux-perf)")
    results = measure(args.servers, args.model_dir, args.seconds, args.rounds)
    common.write_json("attribution.json", {"frequency_hz": FREQUENCY_HZ, "servers": results})
    sys.stdout.write(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
