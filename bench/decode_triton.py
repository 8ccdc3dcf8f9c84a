"""Incremental decoding on mha-serve against Triton's nearest equivalent, side by side in one run.

Triton serves the attention block as a stateless model (bench/compare.py's "Triton + ORT": its
Python backend running model.onnx through ORT, with its dynamic batcher), so a client that
generates one token at a time re-sends the whole prefix at every step and keeps the last row.
mha-serve, with its defaults, keeps the sequence's keys and values: each step sends the new token
with Triton's sequence parameters (`sequence_id`, `sequence_start`, `sequence_end`).

Two measurements, the servers visited in turn, round after round (medians over the rounds):
  - one sequence of `--tokens` tokens: the mean and p50 time per token;
  - `--sequences` concurrent sequences of `--concurrent-tokens` tokens each (a thread per
    sequence, each on a connection of its own, in 4 client processes): tokens per second.
Each with the ratio mha-serve / Triton. Writes bench/results/decode_triton.json. Not a test.

usage: python bench/decode_triton.py [--rounds 3] [--tokens 256] [--sequences 32] [--concurrent-tokens 256]
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import common
import grpc
import numpy as np
from compare import Started
from decode import generate, run_threads

from service.client.client import OWN_CONNECTION
from service.proto import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger("bench")
CLIENT_PROCESSES = 4  # one Python process of client threads would be the bottleneck
SERVERS = {"mha-serve": True, "Triton + ORT": False}  # name: does it keep the sequence (cached steps)?


def one_sequence(url: str, width: int, tokens: int, cached: bool, sequence_id: int) -> list[float]:
    """Seconds per token of one (1, tokens, width) sequence generated one token at a time."""
    x = np.random.default_rng(sequence_id).standard_normal((1, tokens, width), dtype=np.float32)
    with grpc.insecure_channel(url, options=[OWN_CONNECTION]) as channel:
        return generate(pb_grpc.GRPCInferenceServiceStub(channel), x, cached, sequence_id)


def _client_process(url: str, width: int, ids: list[int], tokens: int, cached: bool, start_at: float) -> float:
    """A thread per sequence, all starting at `start_at`: when the last of them finished."""
    return run_threads(ids, start_at, partial(one_sequence, url, width, tokens, cached))


def concurrent_tokens_per_s(
    pool: ProcessPoolExecutor, url: str, width: int, sequences: int, tokens: int, cached: bool, first_id: int
) -> float:
    ids = [list(range(first_id + p, first_id + sequences, CLIENT_PROCESSES)) for p in range(CLIENT_PROCESSES)]
    start_at = time.monotonic() + 1.0
    ends = pool.map(_client_process, *zip(*[(url, width, i, tokens, cached, start_at) for i in ids], strict=True))
    return sequences * tokens / (max(ends) - start_at)


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--concurrent-tokens", type=int, default=256)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    model_dir, width = args.model_dir, 128
    servers: dict[str, Started] = {}
    try:
        for name in SERVERS:
            try:
                servers[name] = Started(name, model_dir, None)
            except LookupError as exc:
                raise SystemExit(str(exc)) from None
            servers[name].ready()
        urls = {name: server.url for name, server in servers.items()}
        per_round: dict[str, dict[str, list[float]]] = {
            n: {"token_mean_ms": [], "token_p50_ms": [], "tokens_per_s": []} for n in SERVERS
        }
        with ProcessPoolExecutor(CLIENT_PROCESSES, mp_context=multiprocessing.get_context("spawn")) as pool:
            for r in range(args.rounds):
                for name, cached in SERVERS.items() if r % 2 == 0 else reversed(SERVERS.items()):
                    one_sequence(urls[name], width, 16, cached, 1 + r)  # warm-up
                    times = one_sequence(urls[name], width, args.tokens, cached, 100 + r)
                    rate = concurrent_tokens_per_s(
                        pool, urls[name], width, args.sequences, args.concurrent_tokens, cached, 10_000 * (r + 1)
                    )
                    row = per_round[name]
                    row["token_mean_ms"].append(statistics.mean(times) * 1e3)
                    row["token_p50_ms"].append(statistics.median(times) * 1e3)
                    row["tokens_per_s"].append(rate)
                    log.info("round %d %s: %s", r + 1, name, {k: round(v[-1], 3) for k, v in row.items()})
    finally:
        for server in servers.values():
            server.stop()
    medians = {n: {k: round(statistics.median(v), 3) for k, v in m.items()} for n, m in per_round.items()}
    ours, theirs = medians["mha-serve"], medians["Triton + ORT"]
    summary = {
        "machine": f"{len(os.sched_getaffinity(0))} CPUs",
        "tokens": args.tokens,
        "sequences": args.sequences,
        "concurrent_tokens": args.concurrent_tokens,
        "rounds": per_round,
        "medians": medians,
        "mha_serve_over_triton": {k: round(ours[k] / theirs[k], 3) for k in ours},
    }
    common.write_json("decode_triton.json", summary)
    log.info("medians %s; mha-serve / Triton %s", medians, summary["mha_serve_over_triton"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
