"""Which exported graph does ONNX Runtime run fastest on this CPU? Side by side, one run.

Exports the default model twice ("attention": one ONNX Attention op; "plain": MatMul/Softmax with
the causal mask built by Trilu), and times both on ORT-CPU and PyTorch SDPA over a few shapes.
Writes bench/results/onnx_graphs.json. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np
import onnxruntime as ort
import torch

from export.layout import INPUT_NAME
from export.onnx_export import export_onnx
from model import MHAConfig, MultiHeadAttention
from model.checkpoint import init_weights

SHAPES = [(1, 1), (1, 64), (4, 128), (4, 512), (8, 1024)]
log = logging.getLogger("bench")


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> int:
    common.parser(__doc__).parse_args()  # --help describes it and runs nothing
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    config = MHAConfig()
    weights = init_weights(config, seed=0)
    threads = torch.get_num_threads()
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for graph in ("attention", "plain"):
            path = Path(tmp) / f"{graph}.onnx"
            export_onnx(config, weights, path, graph=graph)
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            sessions[graph] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    module = MultiHeadAttention.from_weights(config, weights)
    rows = []
    for B, T in SHAPES:
        x = np.random.default_rng(0).standard_normal((B, T, config.d_model), dtype=np.float32)
        xt = torch.from_numpy(x)
        repeats = 50 if B * T <= 512 else 10
        row: dict[str, float] = {"B": B, "T": T}
        for graph, session in sessions.items():
            row[f"ort_{graph}_ms"] = _time(lambda s=session, x=x: s.run(None, {INPUT_NAME: x}), repeats)
        with torch.inference_mode():
            row["torch_sdpa_ms"] = _time(lambda xt=xt: module(xt), repeats)
        row["plain_over_attention"] = row["ort_plain_ms"] / row["ort_attention_ms"]
        row["ort_attention_over_torch"] = row["ort_attention_ms"] / row["torch_sdpa_ms"]
        log.info(
            "B=%d T=%4d  ORT attention %8.3f ms  ORT plain %8.3f ms  torch SDPA %8.3f ms",
            B,
            T,
            row["ort_attention_ms"],
            row["ort_plain_ms"],
            row["torch_sdpa_ms"],
        )
        rows.append(row)
    out = Path(__file__).parent / "results" / "onnx_graphs.json"
    out.parent.mkdir(exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": threads,
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
