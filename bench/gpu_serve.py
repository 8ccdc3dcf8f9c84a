"""Where a served request's time goes on a GPU: transport and front end, queue, compute.

For each `--workers` count, a server (`--backend auto`, the default model) is started and driven
by closed-loop clients at each concurrency, both as one gRPC channel shared by all the clients of
the process and with a connection per client, for `--seconds` each. The server's own statistics
(Triton's ModelStatistics, summed over workers) are read before and after each run, and their
difference split per request:

- queue: waiting for a batch to start; compute: the batch's input copy, inference and output copy;
- server: from the request's arrival to its answer (success.ns);
- front end and transport: the client's mean latency (clients / req/s, a closed loop) less the
  server's time: gRPC, protobuf and the event loop on both sides, and loopback.
- compute busy: the share of the run's wall time in which a batch computed (per worker, summed):
  well below 1 x workers, the GPU waits for the Python front end.

Writes gpu_serve.json under --out (or $OUT) and prints a table. Not a test.

usage: python bench/gpu_serve.py [--workers 1,2] [--clients 1,32] [--seconds 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import grpc

from service.app.launch import ServerProcess
from service.client.loadgen import run_load
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger("gpu_serve")
FIELDS = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def statistics(url: str) -> dict[str, tuple[int, int]]:
    """(count, ns) of each of FIELDS for the stateless model, and executions as ("executions", 0)."""
    with grpc.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mha"), timeout=30).model_stats
    totals = {f: (0, 0) for f in FIELDS} | {"executions": (0, 0)}
    for model in stats:
        for field in FIELDS:
            d = getattr(model.inference_stats, field)
            totals[field] = (totals[field][0] + d.count, totals[field][1] + d.ns)
        totals["executions"] = (totals["executions"][0] + model.execution_count, 0)
    return totals


def split(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], load: Any) -> dict[str, float]:
    """Per request, in ms: the server's parts of the run, and what is left of the client's mean."""
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    requests = max(delta["success"][0], 1)
    per = {k: delta[k][1] / requests / 1e6 for k in FIELDS}
    compute = per["compute_input"] + per["compute_infer"] + per["compute_output"]
    client_mean = load.concurrency / load.throughput_rps * 1e3 if load.throughput_rps else float("nan")
    batches = max(delta["executions"][0], 1)
    return {
        "req_s": load.throughput_rps,
        "client_p50_ms": load.p50_ms,
        "client_mean_ms": client_mean,
        "server_ms": per["success"],
        "queue_ms": per["queue"],
        "compute_ms": compute,
        "compute_input_ms": per["compute_input"],
        "compute_infer_ms": per["compute_infer"],
        "compute_output_ms": per["compute_output"],
        "front_end_and_transport_ms": client_mean - per["success"],
        "requests_per_batch": delta["success"][0] / batches,
        # compute is counted per request (a batch's time once per request in it): per batch, x batches
        "compute_busy": compute * batches / (load.seconds * 1e3),
        "errors": sum(load.errors.values()),
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--clients", default="1,32")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--shapes", default="1x64,4x512", help="request (B)x(T), C is the model's")
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ["--model-dir", args.model_dir] if args.model_dir else []  # none: the default model, exported
    rows: list[dict[str, Any]] = []
    for workers in args.workers.split(","):
        server = ServerProcess([*model, "--backend", "auto"], workers=workers)
        try:
            server.start(out / f"gpu_serve_w{workers}.log", ready_timeout=300)
            for shape in args.shapes.split(","):
                B, T = (int(v) for v in shape.split("x"))
                run_load(server.url, 4, 1.0, [T], batch=B)  # warm-up
                for clients in (int(c) for c in args.clients.split(",")):
                    for own in (False, True):
                        before = statistics(server.url)
                        load = run_load(server.url, clients, args.seconds, [T], batch=B, own_connection=own)
                        row = {"workers": int(workers), "shape": shape, "clients": clients}
                        row["connections"] = "one per client" if own else "one channel"
                        row |= split(before, statistics(server.url), load)
                        rows.append(row)
                        log.info("%s", json.dumps(row))
                        (out / "gpu_serve.json").write_text(json.dumps(rows, indent=1))
        except Exception:
            log.exception("workers=%s failed", workers)
        finally:
            server.kill()
    keys = ["workers", "shape", "clients", "connections", "req_s", "client_p50_ms", "server_ms", "queue_ms"]
    keys += ["compute_ms", "front_end_and_transport_ms", "requests_per_batch", "compute_busy"]
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
