"""gRPC streaming on mha-serve against Triton, measured by Triton's own perf_analyzer.

Both servers serve the default model (mha-serve with its defaults; Triton as bench/compare.py's
"Triton + ORT": ORT in its Python backend, its dynamic batcher), started together. Each round
visits them in turn, the order alternating, and runs `perf_analyzer --streaming` on each at
every concurrency of --concurrency, (1, 64, 128) requests of zeros (`--input-data zero`: the
default random bytes hold NaN and inf, which mha-serve refuses). Reported: each server's median
throughput (infer/s) over the rounds, and mha-serve's over Triton's, round by round. A server
that dies ends the rounds: it is named in the results, with the rounds completed before. Writes
bench/results/streaming_triton.json. Needs `make install` (perf_analyzer) and `make
bench-servers` (Triton). Not a test.

usage: python bench/streaming_triton.py [--rounds 10] [--concurrency 8,32] [--interval-ms 2000]
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import subprocess
import sys

import common
from compare import ROOT, Started

log = logging.getLogger("bench")
SERVERS = ("mha-serve", "Triton + ORT")
PERF_ANALYZER = ROOT / ".venv-perf" / "bin" / "perf_analyzer"
_THROUGHPUT = re.compile(r"Throughput: ([0-9.]+) infer/sec")


def _libraries() -> str:
    """perf_analyzer's shared libraries: Debian's libb64 (.tools) and the CUDA runtime's wheel."""
    found = [ROOT / ".tools" / "libb64" / "usr" / "lib" / "x86_64-linux-gnu"]
    found += sorted((ROOT / ".venv-perf" / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib"))
    return ":".join(str(p) for p in found)


class ServerDied(RuntimeError):
    """A server exited during the rounds."""


def throughput(url: str, concurrency: int, interval_ms: int) -> float:
    """perf_analyzer --streaming at `concurrency` against `url`: infer/s (it waits on a server that
    died, so it is given a bound)."""
    command = [str(PERF_ANALYZER), "-m", "mha", "-u", url, "-i", "grpc", "--streaming", "--shape", "x:64,128"]
    command += ["--input-data", "zero", "--concurrency-range", str(concurrency)]
    command += ["--measurement-interval", str(interval_ms), "--stability-percentage", "999", "--max-trials", "3"]
    env = {**os.environ, "LD_LIBRARY_PATH": _libraries()}
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=interval_ms * 0.01 + 60)
    except subprocess.TimeoutExpired as exc:
        raise ServerDied(f"perf_analyzer against {url} did not finish") from exc
    found = _THROUGHPUT.findall(run.stdout)
    if run.returncode != 0 or not found:
        raise RuntimeError(f"perf_analyzer against {url} failed ({run.returncode}): {run.stdout[-1500:]}{run.stderr}")
    return float(found[-1])


def rounds(
    servers: dict[str, Started],
    seen: dict[str, dict[int, list[float]]],
    count: int,
    levels: list[int],
    interval_ms: int,
) -> str | None:
    """`count` rounds into `seen`; the first server found dead ends them (its name and when)."""
    for r in range(count):
        for name in SERVERS if r % 2 == 0 else tuple(reversed(SERVERS)):
            for c in levels:
                try:
                    seen[name][c].append(throughput(servers[name].url, c, interval_ms))
                except RuntimeError as exc:  # ServerDied too
                    if servers[name].proc.poll() is None:
                        raise
                    log.error("%s died in round %d at concurrency %d: %s", name, r + 1, c, exc)
                    return f"{name}, in round {r + 1} at concurrency {c} (exit {servers[name].proc.returncode})"
        log.info("round %d: %s", r + 1, {n: {c: v[-1] for c, v in s.items()} for n, s in seen.items()})
    return None


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    servers: dict[str, Started] = {}
    seen: dict[str, dict[int, list[float]]] = {name: {c: [] for c in levels} for name in SERVERS}
    try:
        for name in SERVERS:
            try:
                servers[name] = Started(name, args.model_dir, None)
            except LookupError as exc:
                raise SystemExit(str(exc)) from None
            servers[name].ready()
        died = rounds(servers, seen, args.rounds, levels, args.interval_ms)
    finally:
        for server in servers.values():
            server.stop()
    done = min(len(v) for s in seen.values() for v in s.values())
    if done == 0:
        raise SystemExit(f"no round completed: {died}")
    ours, theirs = ({c: v[:done] for c, v in seen[n].items()} for n in SERVERS)
    summary = {
        "died": died,
        "machine": f"{len(os.sched_getaffinity(0))} CPUs",
        "rounds": done,
        "infer_per_s": {n: {c: round(statistics.median(v[:done]), 1) for c, v in s.items()} for n, s in seen.items()},
        "mha_serve_over_triton": {
            c: {
                "median": round(statistics.median(a / b for a, b in zip(ours[c], theirs[c], strict=True)), 3),
                "runs": [round(a / b, 3) for a, b in zip(ours[c], theirs[c], strict=True)],
            }
            for c in levels
        },
        "per_round": seen,
    }
    common.write_json("streaming_triton.json", summary)
    log.info("%s", {k: v for k, v in summary.items() if k != "per_round"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
