"""GPU checks for a machine with a CUDA device: one script, results as JSON under --out (or $OUT).

1. ORT with the CUDA provider: get_providers() starts with CUDAExecutionProvider.
2. Parity of ORT-CUDA and torch-CUDA against the float64 references over a (B, T) grid.
3. `select_backends(auto)` picks ort-cuda; with the CUDA provider made to fail (a backend that
   raises), the chain falls back and keeps answering within tolerance.
4. Timings with CUDA events (median of many runs after warm-up), side by side: ORT-CUDA fp32,
   torch eager fp32 (plain path), torch SDPA fp32/bf16/fp16, over shapes from (4, 512, 128) to
   (8, 4096, 1024); achieved FLOP/s (8·B·T·C² + 4·B·T²·C) against a measured fp32/bf16 matmul rate.

usage: python bench/gpu_check.py [--out DIR] [--quick]
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
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("gpu_check")
SHAPES = [(4, 512, 128, 8), (8, 1024, 256, 8), (8, 2048, 512, 8), (8, 4096, 1024, 16)]


def cuda_time_ms(fn, repeats: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = cuda_time_ms(lambda: a @ b, repeats=20, warmup=5)
    return 2 * n**3 / (ms / 1e3)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not torch.cuda.is_available():
        log.info("no CUDA device: nothing to check")
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import onnxruntime as ort

    from export.layout import INPUT_NAME, OUTPUT_NAME, ModelFiles
    from export.pipeline import export_model_dir
    from export.verify import check_parity, parity_grid
    from model import MHAConfig, MultiHeadAttention
    from model.checkpoint import init_weights
    from service.backends import BackendChain, select_backends
    from service.backends.ort import OrtCudaBackend
    from service.backends.pytorch import TorchBackend
    from service.backends.selection import SelfCheck

    results["device"] = torch.cuda.get_device_name(0)
    results["onnxruntime"] = ort.__version__
    config = MHAConfig()
    weights = init_weights(config, seed=0)
    model_dir = Path(tempfile.mkdtemp()) / "model"
    export_model_dir(model_dir, config, weights)

    ort_cuda = OrtCudaBackend(ModelFiles(model_dir).onnx)
    results["ort_providers"] = ort_cuda._session.get_providers()
    torch_cuda = TorchBackend(config, weights, device="cuda")
    grid = parity_grid(config.max_seq_len)
    for backend in (ort_cuda, torch_cuda):
        report = check_parity(backend.run, config, weights, grid, seed=3)
        results[f"parity_{backend.name}"] = report.to_dict()
        log.info("%s parity:\n%s", backend.name, report.table())

    selection = select_backends(ModelFiles(model_dir).onnx, config, weights, "auto")
    results["auto_order"] = [b.name for b in selection.backends]
    results["auto_reasons"] = selection.summary()

    class Broken(OrtCudaBackend):
        def run(self, x):
            raise RuntimeError("CUDA provider made to fail")

    broken = Broken(ModelFiles(model_dir).onnx)
    fallbacks: list[tuple[str, str, str]] = []
    chain = BackendChain(
        [broken, torch_cuda], probe=SelfCheck(config, weights).passes, on_fallback=lambda *a: fallbacks.append(a)
    )
    report = check_parity(lambda x: chain.run(x)[0], config, weights, grid[:4], seed=4)
    results["fallback"] = {"ok": report.ok, "fallbacks": fallbacks, "benched": chain.benched()}

    rates = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    results["matmul_flops"] = rates
    timings = []
    for B, T, C, nh in SHAPES[:2] if args.quick else SHAPES:
        cfg = MHAConfig(d_model=C, n_head=nh, max_seq_len=T)
        w = init_weights(cfg, seed=1)
        d = Path(tempfile.mkdtemp()) / "m"
        export_model_dir(d, cfg, w)
        x = torch.randn(B, T, C, device="cuda")
        session = OrtCudaBackend(ModelFiles(d).onnx)._session
        binding = session.io_binding()
        y = torch.empty_like(x)
        binding.bind_input(INPUT_NAME, "cuda", 0, np.float32, list(x.shape), x.data_ptr())
        binding.bind_output(OUTPUT_NAME, "cuda", 0, np.float32, list(y.shape), y.data_ptr())
        row: dict[str, object] = {"B": B, "T": T, "C": C, "n_head": nh}
        row["ort_cuda_fp32_ms"] = cuda_time_ms(lambda s=session, b=binding: s.run_with_iobinding(b))
        plain = MultiHeadAttention.from_weights(cfg, w, fast=False).cuda()
        sdpa = MultiHeadAttention.from_weights(cfg, w, fast=True).cuda()
        with torch.inference_mode():
            row["torch_eager_fp32_ms"] = cuda_time_ms(lambda m=plain, xx=x: m(xx))
            row["torch_sdpa_fp32_ms"] = cuda_time_ms(lambda m=sdpa, xx=x: m(xx))
            for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                m16, x16 = MultiHeadAttention.from_weights(cfg, w).cuda().to(dtype), x.to(dtype)
                row[f"torch_sdpa_{name}_ms"] = cuda_time_ms(lambda m=m16, xx=x16: m(xx))
        flops = 8 * B * T * C * C + 4 * B * T * T * C
        row["flops"] = flops
        for key in [k for k in row if k.endswith("_ms")]:
            achieved = flops / (float(row[key]) / 1e3)
            peak = rates["bf16"] if ("bf16" in key or "fp16" in key) else rates["fp32"]
            row[key.replace("_ms", "_of_matmul_peak")] = achieved / peak
        log.info("%s", row)
        timings.append(row)
    results["timings"] = timings
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    log.info(
        "providers %s; auto order %s; fallback ok %s",
        results["ort_providers"],
        results["auto_order"],
        results["fallback"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
