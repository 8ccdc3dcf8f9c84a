"""A decode step against a stateless (1, 1, C) request, side by side in one run.

One `mha serve` per revision (this checkout, and with --base REV the code at REV from a temporary
worktree), all started at once. Each run visits them in turn; a visit interleaves, one by one on
one connection, `--count` one-token steps of a new sequence with as many stateless (1, 1, C)
requests, and keeps both p50s. Reported: per server, the medians over the runs of the step's
p50, the stateless p50 and their ratio; with --base, the ratio of this checkout's step p50 to the
base's, run by run. Writes bench/results/step_cost.json. Not a test.

usage: python bench/step_cost.py [--runs 20] [--count 200] [--base REV] [--model-dir models/default]
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys

import common
from compare import Started, with_base
from decode import step_against_stateless

log = logging.getLogger("bench")


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--base", help="mha-serve at this git revision too")
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        checkouts = with_base(stack, args.base)
        servers: dict[str, Started] = {}
        for name, tree in checkouts.items():  # one at a time: each measures its backends on a quiet machine
            servers[name] = Started(name, args.model_dir, None, tree)
            stack.callback(servers[name].stop)
            servers[name].ready()
        visits: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        for run in range(args.runs):
            order = list(servers) if run % 2 == 0 else list(reversed(servers))
            for name in order:
                visits[name].append(step_against_stateless(servers[name].url, 128, args.count))
            log.info("run %d: %s", run + 1, {n: v[-1] for n, v in visits.items()})
    summary: dict[str, object] = {"runs": args.runs, "count": args.count}
    for name, seen in visits.items():
        summary[name] = {k: round(statistics.median(v[k] for v in seen), 3) for k in seen[0]}
    if args.base:
        ours, base = visits["mha-serve"], visits[f"mha-serve @{args.base}"]
        ratios = [a["cached_step_p50_ms"] / b["cached_step_p50_ms"] for a, b in zip(ours, base, strict=True)]
        summary["step_over_base"] = {
            "median": round(statistics.median(ratios), 3),
            "runs": [round(r, 3) for r in ratios],
        }
    common.write_json("step_cost.json", summary)
    log.info("%s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
