"""Where the server's event loop spends a unary request: cProfile over `mha serve` under load.

The server runs under `python -m cProfile` (the event loop's thread: protocol, codec, call scope,
batcher; the compute runs on the batcher's worker thread and is not in it), serves closed-loop
(1, 64, 128) load from 8 clients, and stops on SIGTERM, which writes the profile. Prints the
functions with the most own time per request and writes bench/results/profile_unary.txt.
Not a test.

usage: python bench/profile_unary.py [--seconds 10] [--model-dir models/default]
"""

from __future__ import annotations

import io
import logging
import pstats
import sys

import common

from service.app.launch import ServerProcess
from service.client.loadgen import run_load

log = logging.getLogger("bench")


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    results = common.RESULTS
    profile = results / "profile_unary.prof"
    server = ServerProcess(["--model-dir", str(args.model_dir), "--backend", "ort-cpu"])
    server.args[1:4] = ["-P", "-m", "cProfile", "-o", str(profile), "-m", "service.cli"]
    try:
        server.start(results / "profile_unary.log")
        result = run_load(server.url, args.clients, args.seconds, [64])
    finally:
        server.terminate(timeout=60)
    out = io.StringIO()
    stats = pstats.Stats(str(profile), stream=out)
    out.write(f"{result.requests} requests in {result.seconds:.1f} s ({result.throughput_rps:.0f} req/s)\n")
    stats.sort_stats("tottime").print_stats(args.top)
    text = out.getvalue()
    (results / "profile_unary.txt").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
