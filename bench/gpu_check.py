"""GPU checks for a machine with a CUDA device: one script, results as JSON under --out (or $OUT).

Sections, each written to gpu_check.json as soon as it ends (an exception is recorded in its
section and the next one runs, so one failure does not lose the run of a scarce device):

1. providers: ORT with the CUDA provider; get_providers() and where ORT placed each node.
2. parity: ORT-CUDA and torch-CUDA against the float64 references over the (B, T) grid, in fp32
   and in fp16 (model.fp16.onnx; torch in fp16) within the format's tolerance, and the step
   graphs on ORT-CUDA over their (B, past, t) grid.
3. selection: `select_backends(auto)` picks ort-cuda; with the CUDA provider made to fail, the
   chain falls back and keeps answering within tolerance.
4. decode: incremental decoding through each backend's decode step (ORT-CUDA on the step graphs with
   IOBinding and torch-CUDA, the caches in device memory; ORT-CPU and torch-CPU): 256 one-token
   steps against the float64 reference, the time per step of each, and the time of the last
   token the stateless way (the whole 256-token prefix sent again).
5. timings: ORT-CUDA fp32 and fp16 (IOBinding on device buffers, and plain session.run from host
   arrays), torch eager fp32, torch SDPA fp32/bf16/fp16 over shapes up to (8, 4096, 1024); each
   timed the same way (synchronize, run, synchronize: ORT runs on its own stream, so CUDA events
   on torch's stream would not see it); FLOP/s (8·B·T·C² + 4·B·T²·C) against a measured matmul
   rate. The timing graphs are exported without the parity grid (the grid runs on the CPU in
   float64: about 30 GB of host RAM at (7, 4096, 1024)); parity is section 2's job.
6. memory: peak device memory of torch and ORT's arena after the timings.

usage: python bench/gpu_check.py [--out DIR] [--quick]
       python bench/gpu_check.py --table bench/results/gpu_check.json   (its results as markdown)
Without a CUDA device it says so and exits 0 having written only that fact.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("gpu_check")
SHAPES = [(4, 512, 128, 8), (8, 1024, 256, 8), (8, 2048, 512, 8), (8, 4096, 1024, 16)]


class Results:
    """gpu_check.json, rewritten after every section."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))

    @contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        entry: dict[str, Any] = {}
        started = time.monotonic()
        try:
            yield entry
        except Exception as exc:  # recorded, and the next section runs
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            log.exception("section %s failed", name)
        entry["seconds"] = round(time.monotonic() - started, 1)
        self.data[name] = entry
        self.write()


def synced_ms(fn: Callable[[], object], repeats: int = 30, warmup: int = 5, idle_s: float = 0.0) -> float:
    """Median wall time of fn between two device synchronizations (any stream, any runtime);
    `idle_s` idle before each run, as a server's backend meets a lone client's next request."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2 * n**3 / (synced_ms(lambda: a @ b, repeats=10, warmup=3) / 1e3)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--table", type=Path, help="print a results file as markdown, and run nothing")
    args = parser.parse_args()
    if args.table is not None:
        print("\n".join(report(json.loads(args.table.read_text()))))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Results(out / "gpu_check.json")
    if not torch.cuda.is_available():
        log.info("no CUDA device: nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import onnxruntime as ort

    from export.pipeline import export_model_dir
    from model import MHAConfig
    from model.checkpoint import init_weights

    results.data["device"] = torch.cuda.get_device_name(0)
    results.data["onnxruntime"] = ort.__version__
    results.data["ort_providers"] = ort.get_available_providers()
    results.data["machine"] = machine()
    results.write()
    config = MHAConfig()
    weights = init_weights(config, seed=0)
    model_dir = Path(tempfile.mkdtemp()) / "model"
    # the served model (full parity grid, step graphs) and its fp16 graph
    export_model_dir(model_dir, config, weights, precisions=("fp32", "fp16"))
    with results.section("providers") as entry:
        providers(entry, model_dir)
    with results.section("parity") as entry:
        parity(entry, model_dir, config, weights)
    with results.section("selection") as entry:
        selection(entry, model_dir, config, weights)
    with results.section("decode") as entry:
        decode(entry, model_dir, config, weights)
    rates: dict[str, float] = {}
    with results.section("matmul_flops") as entry:
        rates.update(fp32=matmul_rate(torch.float32), bf16=matmul_rate(torch.bfloat16))
        entry.update(rates)
    for B, T, C, nh in SHAPES[:2] if args.quick else SHAPES:
        with results.section(f"timing_{B}x{T}x{C}") as entry:
            timing(entry, B, T, C, nh, rates, repeats=10 if args.quick else 30)
    with results.section("memory") as entry:
        entry["torch_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        entry["device_used_mib"] = (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) / 2**20
    log.info(
        "%s", json.dumps({k: v for k, v in results.data.items() if not k.startswith("timing")}, default=str)[:3000]
    )
    log.info("%s", "\n".join(timing_table(results.data)))
    return 0


def report(data: dict[str, Any]) -> list[str]:
    """A results file as markdown: the machine, each check's verdict, the decode steps, the timings."""
    machine = data.get("machine", {})
    lines = [
        f"Machine: {machine.get('nvidia_smi', data.get('device'))}, compute capability "
        f"{machine.get('capability')}, CUDA {machine.get('cuda')}, torch {data.get('torch')}, "
        f"onnxruntime {data.get('onnxruntime')}, {machine.get('cpus')} CPUs.",
        "",
    ]
    providers = data.get("providers", {})
    lines += [f"- providers: {providers.get('get_providers')}; {providers.get('placement')}"]
    for name, result in data.get("parity", {}).items():
        if isinstance(result, dict):
            verdict = "error: " + result["error"][:200] if "error" in result else f"ok={result.get('ok')}"
            lines.append(f"- parity {name}: {verdict}, tolerance {result.get('tolerance')}")
    selection = data.get("selection", {})
    lines.append(f"- auto: {selection.get('auto_order')}; {selection.get('auto_reasons')}")
    lines.append(f"- CUDA provider made to fail: {selection.get('fallback')}")
    lines += [
        "",
        "| decode, 256 one-token steps | caches | relative error | step p50 ms | prefix resent p50 ms |",
        "|---|---|---|---|---|",
    ]
    for name, d in data.get("decode", {}).items():
        if isinstance(d, dict) and "caches_on" in d:
            resend = d.get("resend_prefix_p50_ms")
            lines.append(
                f"| {name} | {d['caches_on']} | {d['relative_error']:.2e} | {d['step_p50_ms']:.3f} | "
                + (f"{resend:.3f} |" if resend is not None else "- |")
            )
    rates = data.get("matmul_flops", {})
    lines += [
        "",
        f"Matrix-multiply rate measured: fp32 {rates.get('fp32', 0) / 1e12:.1f} TFLOP/s, "
        f"bf16 {rates.get('bf16', 0) / 1e12:.0f} TFLOP/s. Timings: ms (share of that rate).",
        "",
    ]
    return lines + timing_table(data)


def timing_table(data: dict[str, Any]) -> list[str]:
    """The timing sections as a markdown table: ms, and the share of the matmul rate in brackets."""
    rows = [v for k, v in data.items() if k.startswith("timing_") and "error" not in v]
    if not rows:
        return ["no timings"]
    names = [k for k in rows[0] if k.endswith("_ms")]
    lines = ["| (B, T, C) | " + " | ".join(n.removesuffix("_ms") for n in names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for row in rows:
        cells = [f"{row[n]:.3f} ({row.get(n.replace('_ms', '_of_matmul_peak'), 0):.0%})" for n in names]
        lines.append(f"| ({row['B']}, {row['T']}, {row['C']}) | " + " | ".join(cells) + " |")
    return lines


def machine() -> dict[str, Any]:
    """The device as nvidia-smi and torch describe it."""
    import subprocess

    query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    smi = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    props = torch.cuda.get_device_properties(0)
    return {
        "nvidia_smi": smi.stdout.strip() or smi.stderr.strip()[:300],
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
    }


def providers(entry: dict[str, Any], model_dir: Path) -> None:
    from service.backends.ort import OrtCudaBackend

    backend = OrtCudaBackend(model_dir / "model.onnx")  # refuses unless compute nodes are on CUDA
    entry["get_providers"] = backend.providers
    entry["placements"] = backend.placements
    entry["placement"] = backend.placement


def parity(entry: dict[str, Any], model_dir: Path, config: Any, weights: Any) -> None:
    from export.layout import ModelFiles, precision_file, precision_tolerance
    from export.verify import check_parity, check_step_parity, parity_grid, step_parity_grid
    from service.backends.base import Step
    from service.backends.ort import OrtCudaBackend
    from service.backends.pytorch import TorchBackend
    from service.backends.selection import ProbeCache

    grid = parity_grid(config.max_seq_len)
    steps = OrtCudaBackend(model_dir / "model.onnx", step_paths=ModelFiles(model_dir).steps)
    for backend in (steps, TorchBackend(config, weights, device="cuda")):
        report = check_parity(backend.run, config, weights, grid, seed=3)
        entry[backend.name] = report.to_dict()
        log.info("%s parity:\n%s", backend.name, report.table())
    half = precision_tolerance("fp16", config)
    for name, make in (
        ("ort-cuda-fp16", lambda: OrtCudaBackend(model_dir / precision_file("fp16"))),
        ("torch-cuda-fp16", lambda: TorchBackend(config, weights, device="cuda", precision="fp16")),
    ):
        try:
            report = check_parity(make().run, config, weights, grid, seed=3, tolerance=half)
        except Exception as exc:  # recorded; the next one runs
            entry[name] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            continue
        entry[name] = report.to_dict()
        log.info("%s parity (tolerance %.1e):\n%s", name, half, report.table())

    def step(x: np.ndarray, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        B, P, t = keys.shape[0], keys.shape[2], x.shape[1]
        cache = ProbeCache.empty(B, config, P + t + 5, "cuda")  # room to spare beyond the new tokens
        cache.keys[:, :, :P], cache.values[:, :, :P] = torch.from_numpy(keys), torch.from_numpy(values)
        cache.length = P
        (y,) = steps.step([Step(cache, x)])
        return y, cache.keys[:, :, : P + t].cpu().numpy(), cache.values[:, :, : P + t].cpu().numpy()

    report = check_step_parity(step, config, weights, step_parity_grid(config.max_seq_len), seed=3)
    entry["step_graph_ort_cuda"] = report.to_dict()
    log.info("step graph parity on ORT-CUDA:\n%s", report.table())


def selection(entry: dict[str, Any], model_dir: Path, config: Any, weights: Any) -> None:
    from export.verify import check_parity, parity_grid
    from service.backends.chain import BackendChain
    from service.backends.ort import OrtCudaBackend
    from service.backends.pytorch import TorchBackend
    from service.backends.selection import BackendSpec, SelfCheck, select_backends

    chosen = select_backends(BackendSpec(model_dir / "model.onnx", config, weights), "auto")
    entry["auto_order"] = [b.name for b in chosen.backends]
    entry["auto_reasons"] = chosen.summary()

    class Broken(OrtCudaBackend):
        def run(self, x: np.ndarray) -> np.ndarray:
            raise RuntimeError("CUDA provider made to fail")

    fallbacks: list[tuple[str, str, str]] = []
    chain = BackendChain(
        [Broken(model_dir / "model.onnx"), TorchBackend(config, weights, device="cuda")],
        probe=SelfCheck(config, weights).passes,
        on_fallback=lambda *a: fallbacks.append(a),
    )
    report = check_parity(lambda x: chain.run(x)[0], config, weights, parity_grid(config.max_seq_len)[:4], seed=4)
    entry["fallback"] = {"ok": report.ok, "fallbacks": fallbacks, "quarantined": chain.quarantined()}


def decode(entry: dict[str, Any], model_dir: Path, config: Any, weights: Any, tokens: int = 256) -> None:
    from export.layout import ModelFiles
    from model.reference import attention_view, relative_error
    from service.backends.base import Step
    from service.backends.ort import OrtCpuBackend, OrtCudaBackend
    from service.backends.pytorch import TorchBackend
    from service.decode.control import SequenceControl
    from service.decode.sequences import SequenceLimits, SequenceStore

    x = np.random.default_rng(6).standard_normal((2, tokens, config.d_model), dtype=np.float32)
    reference = attention_view(torch.from_numpy(x), weights, config)  # (2, tokens, C), float64
    step_paths = ModelFiles(model_dir).steps
    backends = {
        "ort-cuda": lambda: OrtCudaBackend(model_dir / "model.onnx", step_paths=step_paths),
        "torch-cuda": lambda: TorchBackend(config, weights, device="cuda"),
        "ort-cpu": lambda: OrtCpuBackend(model_dir / "model.onnx", threads=4, step_paths=step_paths),
        "torch-cpu": lambda: TorchBackend(config, weights, device="cpu"),
    }
    for name, make in backends.items():
        backend = make()
        store = SequenceStore(config, SequenceLimits(), time.monotonic, device=backend.device)
        sequence = store.open(SequenceControl(1, start=True), 2, config.d_model)
        outputs, times = [], []
        for i in range(tokens):
            store.check_room(sequence, 1)
            start = time.perf_counter()
            (y,) = backend.step([Step(sequence, x[:, i : i + 1])])  # y on the host: synchronized
            times.append(time.perf_counter() - start)
            sequence.length += 1
            outputs.append(y)
        error = relative_error(torch.from_numpy(np.concatenate(outputs, axis=1)), reference)
        resend = []  # the last token the stateless way: the whole prefix sent again
        for _ in range(21):
            start = time.perf_counter()
            backend.run(x)
            resend.append(time.perf_counter() - start)
        entry[name] = {
            "caches_on": str(sequence.keys.device),
            "relative_error": error,
            "ok": error < 1e-5,
            "step_p50_ms": statistics.median(times[16:]) * 1e3,
            "resend_prefix_p50_ms": statistics.median(resend[1:]) * 1e3,
        }
        log.info("decode on %s: %s", name, entry[name])


def timing(entry: dict[str, Any], B: int, T: int, C: int, nh: int, rates: dict[str, float], repeats: int) -> None:
    import onnx

    from export.layout import INPUT_NAME, OUTPUT_NAME
    from export.onnx_export import export_onnx
    from export.step_graph import build_precision_graph
    from model import MHAConfig, MultiHeadAttention
    from model.checkpoint import init_weights
    from service.backends.ort import OrtCudaBackend

    cfg = MHAConfig(d_model=C, n_head=nh, max_seq_len=T)
    w = init_weights(cfg, seed=1)
    path = Path(tempfile.mkdtemp()) / "model.onnx"
    export_onnx(cfg, w, path)  # no parity grid here: section 2 checks the served model
    half_path = path.with_name("model.fp16.onnx")
    onnx.save(build_precision_graph(cfg, w, "fp16"), str(half_path))
    x = torch.randn(B, T, C, device="cuda")
    backend = OrtCudaBackend(path)
    import onnxruntime as ort

    options = [("CUDAExecutionProvider", {"use_tf32": 0})]
    session = ort.InferenceSession(str(path), providers=options)  # the raw session, beside the backend
    y = torch.empty_like(x)
    host = x.cpu().numpy()
    entry.update(B=B, T=T, C=C, n_head=nh)
    half = ort.InferenceSession(str(half_path), providers=options)
    for key, graph in (("ort_cuda_iobinding_device_ms", session), ("ort_cuda_fp16_iobinding_device_ms", half)):
        binding = graph.io_binding()
        binding.bind_input(INPUT_NAME, "cuda", 0, np.float32, list(x.shape), x.data_ptr())
        binding.bind_output(OUTPUT_NAME, "cuda", 0, np.float32, list(y.shape), y.data_ptr())
        entry[key] = synced_ms(partial(graph.run_with_iobinding, binding), repeats)
    entry["ort_cuda_backend_run_from_host_ms"] = synced_ms(lambda: backend.run(host), repeats)
    entry["ort_cuda_session_run_from_host_ms"] = synced_ms(lambda: session.run(None, {INPUT_NAME: host}), repeats)
    # a lone client's request meets a backend idle since the last one: the served compute's gap (docs/gpu.md)
    entry["ort_cuda_backend_run_after_10ms_idle_ms"] = synced_ms(lambda: backend.run(host), 20, idle_s=0.01)
    plain = MultiHeadAttention.from_weights(cfg, w, fast=False).cuda()
    sdpa = MultiHeadAttention.from_weights(cfg, w, fast=True).cuda()
    with torch.inference_mode():
        entry["torch_eager_fp32_ms"] = synced_ms(lambda: plain(x), repeats)
        entry["torch_sdpa_fp32_ms"] = synced_ms(lambda: sdpa(x), repeats)
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            m16, x16 = MultiHeadAttention.from_weights(cfg, w).cuda().to(dtype), x.to(dtype)
            entry[f"torch_sdpa_{name}_ms"] = synced_ms(partial(m16, x16), repeats)
    flops = 8 * B * T * C * C + 4 * B * T * T * C
    entry["flops"] = flops
    for key in [k for k in entry if k.endswith("_ms")]:
        peak = rates.get("bf16" if ("bf16" in key or "fp16" in key) else "fp32")  # fp16's tensor rate is bf16's
        if peak:
            entry[key.replace("_ms", "_of_matmul_peak")] = flops / (float(entry[key]) / 1e3) / peak
    log.info("%s", entry)


if __name__ == "__main__":
    sys.exit(main())
