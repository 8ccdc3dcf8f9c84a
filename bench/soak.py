"""Memory soak per CPU backend: the largest request the attention budget allows, then random
shapes for a while, resident memory sampled throughout. Each backend runs in its own process.

Reports, per backend: RSS after loading, the peak and the residue of the largest allowed request
(and, for ORT, the same without arena shrinkage, side by side), RSS samples over the soak and the
growth after warm-up in MiB per minute. Writes bench/results/soak.json. Not a test.

usage: python bench/soak.py [--minutes 10] [--model-dir models/default] [--max-attention-mb 1024]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np

from export.layout import ModelFiles
from service.backends.base import Backend

log = logging.getLogger("bench")
VARIANTS = ("ort-cpu", "ort-cpu-no-shrink", "torch-cpu")
SAMPLE_S = 10.0
WARM_UP_S = 60.0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _backend(variant: str, files: ModelFiles) -> Backend:
    from model.checkpoint import load_checkpoint

    if variant.startswith("ort-cpu"):
        import service.backends.ort as ort_backends

        if variant == "ort-cpu-no-shrink":
            ort_backends.SHRINK_CELLS = 1 << 62
        return ort_backends.OrtCpuBackend(files.onnx, threads=0)
    from service.backends.pytorch import TorchBackend

    config, weights = load_checkpoint(files.weights)
    return TorchBackend(config, weights)


def child(variant: str, files: ModelFiles, minutes: float, budget_mb: float) -> dict[str, object]:
    from model.checkpoint import load_checkpoint

    config, _ = load_checkpoint(files.weights)
    backend = _backend(variant, files)
    rng = np.random.default_rng(0)
    cells = budget_mb * 2**20 / (4 * config.n_head)  # rows x T x T allowed
    T = config.max_seq_len
    largest = (max(1, int(cells // (T * T))), T)
    out: dict[str, object] = {"variant": variant, "rss_loaded_mib": round(_rss_mib(), 1), "largest": largest}
    backend.run(rng.standard_normal((*largest, config.d_model), dtype=np.float32))
    out |= {"largest_peak_mib": round(_peak_mib(), 1), "largest_residual_mib": round(_rss_mib(), 1)}
    samples, requests, start, next_sample = [], 0, time.monotonic(), 0.0
    while (elapsed := time.monotonic() - start) < minutes * 60:
        B = int(rng.integers(1, 9))
        t = int(rng.integers(1, T + 1))
        backend.run(rng.standard_normal((B, t, config.d_model), dtype=np.float32))
        requests += 1
        if elapsed >= next_sample:
            samples.append((round(elapsed, 1), round(_rss_mib(), 1)))
            next_sample += SAMPLE_S
    samples.append((round(time.monotonic() - start, 1), round(_rss_mib(), 1)))
    out |= {"requests": requests, "samples": samples, "peak_mib": round(_peak_mib(), 1)}
    after = [(t, r) for t, r in samples if t >= WARM_UP_S]
    if len(after) >= 2:
        slope = np.polyfit([t for t, _ in after], [r for _, r in after], 1)[0] * 60
        out |= {
            "rss_after_warm_up_mib": after[0][1],
            "rss_end_mib": after[-1][1],
            "growth_mib_per_min": round(slope, 2),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="soak per backend (default 10)")
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--max-attention-mb", type=float, default=1024.0)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    files = ModelFiles(args.model_dir)
    if args.child:
        minutes = 0.0 if args.child == "ort-cpu-no-shrink" else args.minutes
        sys.stdout.write(json.dumps(child(args.child, files, minutes, args.max_attention_mb)))
        return 0
    results = []
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--child", variant, "--model-dir", str(args.model_dir)]
        command += ["--minutes", str(args.minutes), "--max-attention-mb", str(args.max_attention_mb)]
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        results.append(json.loads(run.stdout))
        log.info("%s", {k: v for k, v in results[-1].items() if k != "samples"})
    path = Path(__file__).parent / "results" / "soak.json"
    path.write_text(json.dumps({"minutes": args.minutes, "results": results}, indent=1) + "\n")
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
