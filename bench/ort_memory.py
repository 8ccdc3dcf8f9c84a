"""ORT-CPU memory as T varies: session variants side by side in one run.

Each variant runs in its own process over the same random (B, T) shapes of the default model
(B in 1..8, T in 1..1024), reporting resident memory every 100 shapes, peak RSS and total time.
Variants: a default session; "ours" (OrtCpuBackend: no memory pattern); no CPU arena at all; a
shared kSameAsRequested arena. Writes bench/results/ort_memory.json. Not a test.

usage: python bench/ort_memory.py [--shapes 600] [--model-dir models/default]
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

from export.layout import INPUT_NAME, ModelFiles

log = logging.getLogger("bench")
VARIANTS = ("default", "ours", "no-arena", "shared-same-as-requested")


def _session(kind: str, model: Path):
    import onnxruntime as ort

    from service.backends.ort import OrtCpuBackend  # every variant loads the same libraries

    if kind == "ours":
        return OrtCpuBackend(model, threads=0).run
    options = ort.SessionOptions()
    if kind == "no-arena":
        options.enable_cpu_mem_arena = False
    if kind == "shared-same-as-requested":
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
        options.add_session_config_entry("session.use_env_allocators", "1")
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {INPUT_NAME: x})[0]


def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def child(kind: str, model: Path, shapes: int) -> dict[str, object]:
    run = _session(kind, model)
    rng = np.random.default_rng(0)
    marks = []
    start = time.perf_counter()
    for i in range(shapes):
        B, T = int(rng.integers(1, 9)), int(rng.integers(1, 1025))
        run(rng.standard_normal((B, T, 128), dtype=np.float32))
        if (i + 1) % 100 == 0:
            marks.append(_rss_mib())
    return {
        "seconds": time.perf_counter() - start,
        "rss_every_100_mib": marks,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=int, default=600)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args()
    model = ModelFiles(args.model_dir).onnx
    if args.child:
        sys.stdout.write(json.dumps(child(args.child, model, args.shapes)))
        return 0
    results: dict[str, dict] = {}
    for kind in VARIANTS:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                kind,
                "--shapes",
                str(args.shapes),
                "--model-dir",
                str(args.model_dir),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[kind] = json.loads(out.stdout)
        r = results[kind]
        log.info(
            "%-25s RSS %s MiB, peak %6.0f MiB, %5.1f s (%.2fx default)",
            kind,
            r["rss_every_100_mib"],
            r["peak_rss_mib"],
            r["seconds"],
            r["seconds"] / results["default"]["seconds"],
        )
    path = Path(__file__).parent / "results" / "ort_memory.json"
    path.write_text(json.dumps({"shapes": args.shapes, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
