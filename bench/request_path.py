"""What one unary ModelInfer costs in mha-serve's own layers, without gRPC: stage by stage, in process.

A server is started in this process (the real engine, batcher, backends and metrics, its gRPC port
bound but not used); its servicer's ModelInfer is called directly on the event loop with a
minimal context, as gRPC would call it once the request is parsed. Each stage (the whole call,
Answers.infer, Door.infer, the batcher, the codec, the checks, one turn of the loop) runs N times
in a row, in R rounds that alternate the stages' order; the median of the rounds' means is
reported, in microseconds of the loop thread's CPU (the compute of a lone small request runs on
it). Warm caches flatter every stage against a server between two requests (there the same work
costs about twice as much: docs/benchmarks.md), so compare stages and versions, not absolute times.

Without --compute (the default) every backend answers with a copy of its input: what is left
is the per-request work the no-compute floor (bench/servers/floor.py none) does not do. Not a test.

Times on a shared VM move by half between spells (docs/benchmarks.md); `--opcodes` counts instead
the Python opcodes one whole call executes (sys.settrace), by file: the same on every run of
the same code, so two versions compare exactly, though C work (protobuf, numpy, locks) is not in it.

usage: python bench/request_path.py [--calls 2000] [--rounds 5] [--batch 1] [--seq-len 64] [--compute]
       [--opcodes] [--model-dir models/default]
Writes bench/results/request_path_no_compute.json (or _compute.json with --compute).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import common
import numpy as np
from prometheus_client import CollectorRegistry

from service.app.server import Running, drain_and_stop, load_and_serve, start
from service.numerics import all_finite
from service.proto import grpc_service_pb2 as pb
from service.protocol.answer import Answers
from service.protocol.calls import Calls
from service.protocol.grpc_codec import encode_infer_request, request_from_proto, response_to_proto
from service.protocol.grpc_servicer import InferenceServicer
from service.protocol.inference import answered, decode_input
from service.settings import Settings

log = logging.getLogger("bench")

Stage = Callable[[], Awaitable[Any]]


class QuietContext:
    """What the unary path asks of a grpc.aio.ServicerContext when the request is valid."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("user-agent", "grpc-python/bench"),)

    async def abort(self, code: object, details: str) -> None:
        raise RuntimeError(f"the request was refused: {code} {details}")


def stages(running: Running, x: np.ndarray) -> dict[str, Stage]:
    engine, regions = running.engine, running.regions
    assert regions is not None
    version = engine.loaded
    model, batcher, door = version.model, version.batcher, engine.door
    answers = Answers(door, regions)
    servicer = InferenceServicer(door, answers, Calls(door, engine.metrics, engine.tracing))
    request, context = encode_infer_request(x, model.name, "", "bench"), QuietContext()

    async def whole() -> Any:
        return await servicer.ModelInfer(request, context)  # type: ignore[arg-type]

    neutral = request_from_proto(request)

    async def answer() -> Any:
        return await answers.infer(request_from_proto(request), None)

    async def infer() -> Any:
        return await door.infer(version, x, None, (0, None), "")

    async def submit() -> Any:
        return await batcher.submit(x, None)

    async def decode() -> Any:
        return decode_input(request_from_proto(request), model, regions)

    async def encode() -> pb.ModelInferResponse:
        return response_to_proto(answered(neutral, model, x, "ort-cpu"))

    async def checks() -> Any:
        model.check_magnitude(x)  # the input's magnitude bound, then the output's finiteness
        return all_finite(x)

    async def chain() -> Any:
        return version.chain.run(x)

    async def turn() -> None:
        await asyncio.sleep(0)

    return {
        "ModelInfer (servicer, no gRPC)": whole,
        "Answers.infer (protocol)": answer,
        "Door.infer (engine)": infer,
        "batcher.submit": submit,
        "request_from_proto + decode_input": decode,
        "answered + response_to_proto": encode,
        "input and output checks": checks,
        "backend chain": chain,
        "one turn of the event loop": turn,
    }


async def measure(running: Running, x: np.ndarray, calls: int, rounds: int) -> dict[str, float]:
    """Per stage, the median over `rounds` of the mean loop-thread CPU microseconds per call."""
    timed = stages(running, x)
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for stage in timed.values():  # warm-up: first calls allocate
        for _ in range(200):
            await stage()
    for r in range(rounds):
        names = list(timed) if r % 2 == 0 else list(reversed(timed))
        for name in names:
            stage = timed[name]
            await asyncio.sleep(0)  # bookkeeping deferred by the previous stage runs here, not in this one
            start_cpu = time.thread_time()
            for _ in range(calls):
                await stage()
            await asyncio.sleep(0)  # ... and this stage's runs inside its own time
            samples[name].append((time.thread_time() - start_cpu) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


async def opcodes(running: Running, x: np.ndarray, calls: int) -> dict[str, float]:
    """Python opcodes per whole call, by file (and in all): deterministic, unlike time."""
    whole = stages(running, x)["ModelInfer (servicer, no gRPC)"]
    for _ in range(200):
        await whole()
    await asyncio.sleep(0)
    counts: collections.Counter[str] = collections.Counter()

    def trace(frame: Any, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[frame.f_code.co_filename] += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(calls):
            await whole()
        await asyncio.sleep(0)  # the calls' deferred bookkeeping, in
    finally:
        sys.settrace(None)
    per_call = {_short(name): n / calls for name, n in counts.most_common()}
    return {"all": sum(per_call.values()), **per_call}


def _short(path: str) -> str:
    """A file's name from where it matters: the project's, a package's or the standard library's."""
    for marker in ("/site-packages/", f"/lib/python{sys.version_info.major}.{sys.version_info.minor}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:  # "<string>" (dataclasses' generated code), or a file elsewhere
        return path


async def run(
    settings: Settings, shape: tuple[int, int, int], calls: int, rounds: int, compute: bool, count: bool = False
) -> dict:
    running = await start(settings, CollectorRegistry())
    try:
        await load_and_serve(running)
        if not compute:  # each backend answers with a copy: the layers around the compute alone
            for backend in running.engine.loaded.chain.backends:  # the batcher holds the chain's run
                backend.run = _copy  # type: ignore[method-assign]
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)  # (B, T, C)
        return await (opcodes(running, x, min(calls, 500)) if count else measure(running, x, calls, rounds))
    finally:
        await drain_and_stop(running, 1.0, announce=False)


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--calls", type=int, default=2000, help="calls of each stage per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="B of the (B, T, C) request")
    parser.add_argument("--seq-len", type=int, default=64, help="T of the (B, T, C) request")
    parser.add_argument("--compute", action="store_true", help="run the real backend chain, not a copy")
    parser.add_argument("--opcodes", action="store_true", help="count Python opcodes per call instead of timing")
    args = parser.parse_args()
    settings = replace(
        Settings(model_dir=args.model_dir, host="127.0.0.1", grpc_port=0, http_port=None, metrics_port=None),
        log_format="text",
        log_level="WARNING",
        audit_rate=Settings.audit_rate if args.compute else 0.0,  # a copy is not the model: no audit flags it
    )
    shape = (args.batch, args.seq_len, settings_width(args.model_dir))
    results = asyncio.run(run(settings, shape, args.calls, args.rounds, args.compute, args.opcodes))
    what = "compute" if args.compute else "no compute"
    if args.opcodes:
        lines = [f"{n:8.1f}  {name}" for name, n in results.items()]
        log.info("%s, %s, Python opcodes per call, by file:\n%s", shape, what, "\n".join(lines[:30]))
        out, key = "request_path_opcodes.json", "opcodes_per_call"
    else:
        lines = [f"{name:32s} {us:8.1f} us" for name, us in results.items()]
        log.info("%s, %s, median of %d rounds of %d calls:\n%s", shape, what, args.rounds, args.calls, "\n".join(lines))
        out, key = f"request_path_{'compute' if args.compute else 'no_compute'}.json", "us_per_call"
    common.write_json(out, {"shape": str(shape), "compute": args.compute, key: results})
    return 0


def _copy(x: np.ndarray) -> np.ndarray:
    return x.copy()


def settings_width(model_dir: Path) -> int:
    from model.checkpoint import load_checkpoint

    config, _ = load_checkpoint(model_dir / "weights.safetensors")
    return config.d_model


if __name__ == "__main__":
    sys.exit(main())
