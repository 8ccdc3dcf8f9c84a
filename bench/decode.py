"""Incremental decoding against re-sending the whole prefix, side by side in one run.

A real `mha serve` process per model; one gRPC client generates a sequence one token at a time:
  - cached: Triton's sequence parameters, each step sends the new token (B = 1, t = 1);
  - full recompute: each step sends the whole prefix as a stateless request and keeps the last row.
Both runs see the same tokens. For d_model 512 (8 heads) over 1024 tokens and the default model
over 512: total time, and time per token against position. Then, on the default model, tokens
per second with 1, 8 and 32 concurrent sequences (one client thread each), the same clients
against a server that computes nothing (the ceiling this machine's clients and gRPC allow), and
the p50 of a cached step against a stateless (1, 1, C) request. Writes bench/results/decode.json and
bench/results/decode.png. Not a test.

With --runs N (and --base REV), first N interleaved rounds on the d_model 512 model: each round
generates --tokens-512 tokens with the cache and re-sending the prefix on this checkout's server
(and with the cache on REV's, its model exported by REV's own code), visiting them in turn, the
order alternating; per round the time per token's last 64 steps over its first 64, and the
total time re-sending the prefix over the cached. Medians and every round go into decode.json.

With --wide-only (and --backend NAME), only the d_model 512 model's two runs, on a server of that
backend (for a GPU machine: ort-cuda, torch): bench/results/decode_wide_NAME.json.

usage: python bench/decode.py [--tokens-512 1024] [--tokens-default 512] [--concurrent-tokens 128]
                              [--runs 10] [--base REV] [--backend auto] [--wide-only]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import common
import grpc
import numpy as np

from service.app.launch import ServerProcess, free_port
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request

log = logging.getLogger("bench")


def _step_request(x: np.ndarray, sequence_id: int, start: bool, end: bool) -> pb.ModelInferRequest:
    request = encode_infer_request(x)
    request.parameters["sequence_id"].int64_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return request


def generate(stub: pb_grpc.GRPCInferenceServiceStub, tokens: np.ndarray, cached: bool, sequence_id: int) -> list[float]:
    """Seconds per step for a (1, N, C) sequence fed one token at a time."""
    times = []
    n = tokens.shape[1]
    for i in range(n):
        if cached:
            request = _step_request(tokens[:, i : i + 1], sequence_id, start=i == 0, end=i == n - 1)
        else:
            request = encode_infer_request(tokens[:, : i + 1])  # the whole prefix, every step
        start = time.perf_counter()
        y = decode_infer_response(stub.ModelInfer(request, timeout=60))
        times.append(time.perf_counter() - start)
        assert y.shape[1] == (1 if cached else i + 1)
    return times


def _flatness(cached: list[float]) -> float:
    """The median time of the last 64 steps over that of the first 64."""
    return round(float(np.median(cached[-64:]) / np.median(cached[:64])), 3)


def interleaved_rounds(wide: Path, tokens: int, runs: int, base: tuple[str, Path, Path] | None) -> dict[str, object]:
    """`runs` rounds on the d_model 512 model in `wide` (and REV's server on its own export)."""
    from compare import Started

    servers = {"mha-serve": Started("mha-serve", wide, None)}
    if base is not None:
        revision, tree, base_wide = base
        servers[f"mha-serve @{revision}"] = Started(f"mha-serve @{revision}", base_wide, None, tree)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    x = np.random.default_rng(0).standard_normal((1, tokens, 512), dtype=np.float32)
    try:
        for server in servers.values():
            server.ready(width=512)
        for run in range(runs):
            order = list(servers) if run % 2 == 0 else list(reversed(servers))
            for name in order:
                with grpc.insecure_channel(servers[name].url) as channel:
                    stub = pb_grpc.GRPCInferenceServiceStub(channel)
                    cached = generate(stub, x, cached=True, sequence_id=100 + run)
                    seen = {"cached_total_s": round(sum(cached), 3), "last_over_first": _flatness(cached)}
                    if name == "mha-serve":
                        full = generate(stub, x, cached=False, sequence_id=0)
                        seen["recompute_over_cached"] = round(sum(full) / sum(cached), 2)
                rounds[name].append(seen)
            log.info("round %d: %s", run + 1, {name: seen[-1] for name, seen in rounds.items()})
    finally:
        for server in servers.values():
            server.stop()
    return {
        name: {
            "median": {k: round(statistics.median(r[k] for r in seen), 3) for k in seen[0]},
            "rounds": seen,
        }
        for name, seen in rounds.items()
    }


def export_512(out: Path, tree: Path | None = None) -> Path:
    """The d_model 512 model (8 heads, max_seq_len 1024) exported by the code in `tree` (a
    revision's worktree, for its own server), else by this checkout's."""
    from compare import ROOT

    export = [sys.executable, "-P", "-m", "service.cli", "export", "--out", str(out), "--d-model", "512"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree or ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([*export, "--n-head", "8", "--max-seq-len", "1024"], check=True, capture_output=True, env=env)
    return out


def compare_one_model(model_dir: Path, tokens: int, width: int, logs: Path, backend: str = "auto") -> dict[str, object]:
    server = ServerProcess(["--model-dir", str(model_dir), "--backend", backend])
    server.start(logs)
    try:
        x = np.random.default_rng(0).standard_normal((1, tokens, width), dtype=np.float32)
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            generate(stub, x[:, :16], cached=True, sequence_id=1)  # warm-up
            cached = generate(stub, x, cached=True, sequence_id=2)
            full = generate(stub, x, cached=False, sequence_id=0)
            step = stub.ModelInfer(_step_request(x[:, :1], 3, start=True, end=True), timeout=60)
            stateless = stub.ModelInfer(encode_infer_request(x[:, :8]), timeout=60)
    finally:
        server.terminate()
    first, last = np.median(cached[:64]), np.median(cached[-64:])
    result = {
        "d_model": width,
        "tokens": tokens,
        "backend": backend,
        "steps_served_by": step.parameters["backend"].string_param,
        "requests_served_by": stateless.parameters["backend"].string_param,
        "cached_total_s": round(sum(cached), 3),
        "recompute_total_s": round(sum(full), 3),
        "recompute_over_cached": round(sum(full) / sum(cached), 2),
        "cached_first64_median_ms": round(first * 1e3, 3),
        "cached_last64_median_ms": round(last * 1e3, 3),
        "cached_last_over_first": round(float(last / first), 2),
        "cached_ms": [round(t * 1e3, 3) for t in cached],
        "recompute_ms": [round(t * 1e3, 3) for t in full],
    }
    log.info("%s", {k: v for k, v in result.items() if not k.endswith("_ms")})
    return result


def run_threads(ids: list[int], start_at: float, work: Callable[[int], object]) -> float:
    """`work(id)` on a thread per id, all starting at `start_at` (time.monotonic is one clock for
    every process): when the last finished. The first failure is raised once all have ended."""
    failures: list[BaseException] = []
    ends: list[float] = []

    def run(sequence_id: int) -> None:
        time.sleep(max(0.0, start_at - time.monotonic()))
        try:
            work(sequence_id)
        except BaseException as exc:  # reported below
            failures.append(exc)
        ends.append(time.monotonic())

    threads = [threading.Thread(target=run, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return max(ends)


def _client_process(url: str, width: int, ids: list[int], tokens: int, start_at: float) -> tuple[float, float]:
    """One client process: a thread per sequence, each on a channel of its own. Returns when its
    first started and its last finished."""

    def one(sequence_id: int) -> None:
        x = np.random.default_rng(sequence_id).standard_normal((1, tokens, width), dtype=np.float32)
        with grpc.insecure_channel(url) as channel:
            generate(pb_grpc.GRPCInferenceServiceStub(channel), x, cached=True, sequence_id=sequence_id)

    return start_at, run_threads(ids, start_at, one)


def concurrent_sequences(url: str, width: int, sequences: int, tokens: int) -> float:
    """Tokens per second of `sequences` concurrent sequences, each generating `tokens` tokens,
    from up to 4 client processes (one Python process of client threads would be the bottleneck)."""
    processes = min(sequences, 4)
    ids = [list(range(10_000 + p, 10_000 + sequences, processes)) for p in range(processes)]
    start_at = time.monotonic() + 3.0  # time for the processes to start and connect
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        spans = list(
            pool.map(
                _client_process,
                [url] * processes,
                [width] * processes,
                ids,
                [tokens] * processes,
                [start_at] * processes,
            )
        )
    elapsed = max(end for _, end in spans) - start_at
    return sequences * tokens / elapsed


def ceiling(model_dir: Path, width: int, tokens: int) -> dict[int, float]:
    """The same clients against the no-compute floor server (bench/servers/floor.py, which answers
    each step with its input): what this machine's clients and gRPC allow, whatever the server."""
    from compare import server_command, wait_ready

    port = free_port()
    started = server_command("floor: no compute", model_dir.resolve(), port)
    assert started is not None, "the floor server runs in this environment"
    command, env = started
    proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        return {n: round(concurrent_sequences(url, width, n, tokens), 1) for n in (1, 8, 32)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def step_against_stateless(url: str, width: int, count: int = 300) -> dict[str, float]:
    """p50 of a cached one-token step against a stateless (1, 1, C) request, interleaved one by one
    on one connection so that both see the same machine."""
    x = np.random.default_rng(1).standard_normal((1, count, width), dtype=np.float32)
    cached: list[float] = []
    stateless: list[float] = []
    with grpc.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for i in range(count):
            step = _step_request(x[:, i : i + 1], 77, start=i == 0, end=i == count - 1)
            plain = encode_infer_request(x[:, i : i + 1])
            for request, times in ((step, cached), (plain, stateless)):
                start = time.perf_counter()
                stub.ModelInfer(request, timeout=60)
                times.append(time.perf_counter() - start)
    step_ms, plain_ms = float(np.median(cached[20:])), float(np.median(stateless[20:]))
    return {
        "cached_step_p50_ms": round(step_ms * 1e3, 3),
        "stateless_1x1_p50_ms": round(plain_ms * 1e3, 3),
        "ratio": round(step_ms / plain_ms, 2),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), constrained_layout=True)
    for ax, r in zip(np.atleast_1d(axes), results, strict=True):
        positions = np.arange(1, r["tokens"] + 1)
        ax.plot(positions, r["recompute_ms"], ",", color="tab:red", alpha=0.5, label="re-send the prefix")
        ax.plot(positions, r["cached_ms"], ",", color="tab:blue", alpha=0.5, label="KV cache (sequence_id)")
        ax.set(
            yscale="log",
            xlabel="position (tokens so far)",
            ylabel="ms per token",
            title=f"d_model {r['d_model']}: {r['recompute_over_cached']}x less total time",
        )
        ax.legend(markerscale=20)
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--tokens-512", type=int, default=1024)
    parser.add_argument("--tokens-default", type=int, default=512)
    parser.add_argument("--concurrent-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1, help="interleaved rounds on the d_model 512 model first")
    parser.add_argument("--base", help="with --runs: mha-serve at this git revision too")
    parser.add_argument("--backend", default="auto", help="the servers' --backend")
    parser.add_argument("--wide-only", action="store_true", help="only the d_model 512 model: decode_wide_BACKEND.json")
    args = parser.parse_args()
    results = common.RESULTS
    if args.wide_only:
        with tempfile.TemporaryDirectory() as tmp:
            wide = export_512(Path(tmp) / "d512")
            logs = results / f"decode-512-{args.backend}.log"
            only = compare_one_model(wide, args.tokens_512, 512, logs, args.backend)
        common.write_json(f"decode_wide_{args.backend}.json", only)
        return 0
    try:  # the second half serves the default model: a missing one is said now, not minutes in
        default = common.model_dir(common.DEFAULT_MODEL)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    interleaved: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        wide = export_512(Path(tmp) / "d512")
        if args.runs > 1:
            from compare import checkout

            base = None
            if args.base:
                tree = stack.enter_context(checkout(args.base))
                base = (args.base, tree, export_512(Path(tmp) / "d512-base", tree))
            interleaved = interleaved_rounds(wide, args.tokens_512, args.runs, base)
        runs = [compare_one_model(wide, args.tokens_512, 512, results / "decode-512.log")]
    runs.append(compare_one_model(default, args.tokens_default, 128, results / "decode-default.log"))
    server = ServerProcess(["--model-dir", str(default)])
    server.start(results / "decode-concurrent.log")
    try:
        rates = {n: round(concurrent_sequences(server.url, 128, n, args.concurrent_tokens), 1) for n in (1, 8, 32)}
        versus = step_against_stateless(server.url, 128)
    finally:
        server.terminate()
    floor = ceiling(default, 128, args.concurrent_tokens)
    log.info("tokens/s by concurrent sequences: %s; a cached step against a stateless (1, 1, C): %s", rates, versus)
    log.info("the same clients against a server that computes nothing: %s", floor)
    summary = {
        "interleaved_512": interleaved,
        "models": runs,
        "tokens_per_s": rates,
        "32_over_1": round(rates[32] / rates[1], 2),
        "no_compute_server_tokens_per_s": floor,
        "no_compute_32_over_our_1": round(floor[32] / rates[1], 2),
        "step": versus,
    }
    common.write_json("decode.json", summary)
    plot(runs, results / "decode.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
