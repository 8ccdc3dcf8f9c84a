"""How long `mha serve` takes to start, to its first answer, and what its supervisor holds.

One start per revision per run (this checkout, and with --base REV the code at REV from a temporary
worktree), one at a time, the order alternating run by run; each start is stopped before the next.
Each start serves an exported model with the defaults (one worker per CPU), its ports picked
free. Timed from the spawn to the first ModelInfer answered (compare.py's readiness check, polling
every 0.1 s, so read these as 0.1 s coarse; with workers the server answers once every worker is
ready); then the supervisor's resident memory. Reported: the medians over the runs and,
with --base, this checkout's over the base's, run by run. Writes bench/results/startup.json.
Not a test.

usage: python bench/startup.py [--runs 10] [--base REV] [--model-dir models/default]
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
from compare import ROOT, server_command, wait_ready, with_base

from service.app.launch import free_ports

log = logging.getLogger("bench")
POLL_S = 0.1  # how often a start is asked whether it answers: the figures' resolution


def one_start(model_dir: Path, tree: Path | None, log_path: Path) -> dict[str, float]:
    """Start, time, stop one server from `tree` (None: this checkout)."""
    port = free_ports(1)[0]
    found = server_command("mha-serve", model_dir, port, tree)
    assert found is not None
    command, env = found
    with log_path.open("wb") as out:
        began = time.monotonic()
        proc = subprocess.Popen(command, env={**os.environ, **env}, cwd=ROOT, stdout=out, stderr=out)
        try:
            wait_ready(f"127.0.0.1:{port}", proc, every_s=POLL_S, log_path=log_path)
            answered = time.monotonic() - began
            memory = common.rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"first_answer_s": round(answered, 2), "supervisor_mib": round(memory, 1)}


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--base", help="mha-serve at this git revision too")
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        trees = with_base(stack, args.base)
        starts: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for run in range(args.runs):
            for name in list(trees) if run % 2 == 0 else list(reversed(trees)):
                slug = "base" if "@" in name else "this"
                logged = common.RESULTS / f"startup-{slug}.log"
                starts[name].append(one_start(args.model_dir, trees[name], logged))
            log.info("run %d: %s", run + 1, {n: s[-1] for n, s in starts.items()})
    summary: dict[str, object] = {"runs": args.runs, "starts": starts}
    for name, seen in starts.items():
        summary[name] = {k: round(statistics.median(s[k] for s in seen), 2) for k in seen[0]}
    if args.base:
        ours, base = starts["mha-serve"], starts[f"mha-serve @{args.base}"]
        summary["over_base"] = {
            k: {
                "median": round(statistics.median(a[k] / b[k] for a, b in zip(ours, base, strict=True)), 3),
                "runs": [round(a[k] / b[k], 3) for a, b in zip(ours, base, strict=True)],
            }
            for k in ours[0]
        }
    common.write_json("startup.json", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
