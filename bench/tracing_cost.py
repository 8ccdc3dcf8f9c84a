"""What tracing costs: server CPU per request and latency with tracing off, and on at sampling 1.0,
against the code before tracing existed, side by side in one run.

Three `mha serve` processes stay up together: the baseline (`--baseline DIR`, a checkout of the
commit before tracing; skipped without it), this code with tracing off (the default), and this
code with every request traced (`OTEL_TRACES_SAMPLER=always_on`, spans exported over OTLP/HTTP to
a local sink that accepts and drops them). Closed-loop (1, 64, 128) load visits them in turn,
A B C A B C ..., for `--rounds` rounds at 1 and at 8 clients, so a noisy spell hits all three;
the median of each is reported, and its ratio to the baseline (or to tracing off).
Writes bench/results/tracing_cost.json. Not a test.

usage: python bench/tracing_cost.py [--baseline DIR] [--rounds 5] [--seconds 3] [--model-dir models/default]
"""

from __future__ import annotations

import http.server
import logging
import statistics
import sys
import threading
from pathlib import Path

import common

from service.app.launch import ServerProcess
from service.client.loadgen import run_load, server_cpu_seconds

log = logging.getLogger("bench")


class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def one_round(server: ServerProcess, clients: int, seconds: float) -> tuple[float, float]:
    """(server CPU ms per request, p50 ms) of one closed-loop run."""
    metrics = f"127.0.0.1:{server.metrics_port}"
    before = server_cpu_seconds(metrics)
    result = run_load(server.url, clients, seconds, [64])
    after = server_cpu_seconds(metrics)
    assert before is not None and after is not None, "the server's /metrics could not be read"
    return (after - before) / max(result.requests, 1) * 1e3, result.p50_ms


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--baseline", type=Path, help="a checkout of the code before tracing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    base = ["--model-dir", str(args.model_dir), "--backend", "torch"]
    servers: dict[str, ServerProcess] = {}
    if args.baseline is not None:
        servers["baseline"] = ServerProcess(base)
        servers["baseline"].env["PYTHONPATH"] = str(args.baseline.resolve())
    servers["tracing off"] = ServerProcess(base)
    servers["tracing on (1.0)"] = ServerProcess(
        [*base, "--otlp-endpoint", endpoint], env={"OTEL_TRACES_SAMPLER": "always_on"}
    )
    results: dict[str, dict[int, list[tuple[float, float]]]] = {name: {1: [], 8: []} for name in servers}
    try:
        for name, server in servers.items():
            server.start(common.RESULTS / f"tracing-cost-{name.split()[0]}-{name.split()[-1]}.log")
            run_load(server.url, 2, 1.0, [64])  # warm-up
        for round_ in range(args.rounds):
            for clients in (1, 8):
                for name, server in servers.items():
                    results[name][clients].append(one_round(server, clients, args.seconds))
            log.info("round %d of %d done", round_ + 1, args.rounds)
    finally:
        for server in servers.values():
            server.terminate()
        sink.shutdown()
    reference = "baseline" if "baseline" in servers else "tracing off"
    rows = []
    for clients in (1, 8):
        ref_cpu = statistics.median(c for c, _ in results[reference][clients])
        ref_p50 = statistics.median(p for _, p in results[reference][clients])
        for name in servers:
            cpus, p50s = [c for c, _ in results[name][clients]], [p for _, p in results[name][clients]]
            row = {
                "server": name,
                "clients": clients,
                "cpu_ms_per_request": round(statistics.median(cpus), 4),
                "cpu_ratio": round(statistics.median(cpus) / ref_cpu, 3),
                "cpu_rounds": [round(c, 4) for c in cpus],
                "p50_ms": round(statistics.median(p50s), 3),
                "p50_ratio": round(statistics.median(p50s) / ref_p50, 3),
            }
            rows.append(row)
            log.info("%s", row)
    common.write_json("tracing_cost.json", {"reference": reference, "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
