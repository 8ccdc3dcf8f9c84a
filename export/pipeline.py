"""`mha export`: checkpoint -> model directory (model.onnx, weights.safetensors, manifest.json)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from export.layout import (
    CACHE_NAMES,
    INPUT_NAME,
    MANIFEST_FILE,
    MODEL_FILE,
    OUTPUT_NAME,
    PAST_LENGTH_NAME,
    PROJECTED_NAMES,
    STEP_ATTEND_FILE,
    STEP_PROJECT_FILE,
    WEIGHTS_FILE,
    precision_file,
    precision_tolerance,
)
from export.onnx_export import DEFAULT_OPSET, ExportError, export_onnx
from export.serving_graph import serving_graph
from export.step_graph import build_precision_graph, export_step_graphs
from export.verify import (
    TOLERANCE,
    ParityReport,
    check_parity,
    check_step_parity,
    ort_cpu_runner,
    ort_step_runner,
    parity_grid,
    sha256_file,
    step_parity_grid,
)
from model import MHAConfig
from model.checkpoint import Weights, save_checkpoint

log = logging.getLogger(__name__)


class ParityError(RuntimeError):
    """The exported model disagrees with the float64 references; nothing was written."""

    def __init__(self, report: ParityReport) -> None:
        super().__init__(f"exported model fails parity (tolerance {report.tolerance:.0e}):\n{report.table()}")
        self.report = report


def export_model_dir(
    out: Path,
    config: MHAConfig,
    weights: Weights,
    opset: int = DEFAULT_OPSET,
    graph: str = "attention",
    tolerance: float = TOLERANCE,
    precisions: tuple[str, ...] = ("fp32",),
) -> ParityReport:
    """Export, verify, and only then move the files into `out`: weights, model.onnx, the step graphs
    (causal models), a graph per extra precision (fp16, bf16), manifest.json last."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out) as tmp:
        staging = Path(tmp)
        log.info(
            "writing weights (C=%d, heads=%d, max_seq_len=%d, causal=%s)",
            config.d_model,
            config.n_head,
            config.max_seq_len,
            config.causal,
        )
        save_checkpoint(staging / WEIGHTS_FILE, weights, config)
        export_onnx(config, weights, staging / MODEL_FILE, opset=opset, graph=graph)
        rewrites = _rewrite_for_serving(staging / MODEL_FILE)  # verified below, as it will be served
        grid = parity_grid(config.max_seq_len)
        log.info("checking parity on ONNX Runtime (CPU) over %d (B, T) shapes", len(grid))
        report = check_parity(ort_cpu_runner(staging / MODEL_FILE), config, weights, grid, tolerance=tolerance)
        if not report.ok:
            raise ParityError(report)
        files = [WEIGHTS_FILE, MODEL_FILE]
        step_report = _export_step(staging, config, weights, tolerance)
        if step_report is not None:
            files += [STEP_PROJECT_FILE, STEP_ATTEND_FILE]
        halves = {p: _export_precision(staging, config, weights, p) for p in precisions if p != "fp32"}
        files += [precision_file(p) for p in halves]
        manifest = _manifest(staging, config, opset, graph, report, step_report, files)
        manifest["serving_rewrites"] = rewrites
        manifest["precisions"] = {"fp32": {"file": MODEL_FILE, "tolerance": tolerance}} | {
            p: {"file": precision_file(p), "tolerance": r.tolerance, "parity": r.to_dict()} for p, r in halves.items()
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        for name in (*files, MANIFEST_FILE):  # manifest last: it vouches for the others
            os.replace(staging / name, out / name)
        if step_report is not None:  # the caller's table shows both graphs
            report.rows += step_report.rows
    log.info("wrote %s (%s %.1f KiB)", out, MODEL_FILE, (out / MODEL_FILE).stat().st_size / 1024)
    return report


def ensure_default_model(directory: Path) -> Path:
    """The default model's directory, exported first (seed 0, default config) unless it holds a
    complete export (its manifest is written last)."""
    from model.checkpoint import init_weights

    if not (Path(directory) / MANIFEST_FILE).is_file():
        log.info("no default model in %s: exporting it there (seed 0, default config; about 10 s)", directory)
        export_model_dir(Path(directory), MHAConfig(), init_weights(MHAConfig(), seed=0))
    return Path(directory)


def _rewrite_for_serving(path: Path) -> list[str]:
    """model.onnx in place, with the serving rewrites that apply to it (export/serving_graph.py:
    the same arithmetic in fewer nodes), so that the file manifest.json vouches for is the graph
    ONNX Runtime serves; the names of the rewrites done."""
    rewritten, done = serving_graph(onnx.load(str(path)))
    if done:
        onnx.save(rewritten, str(path))
        log.info("model.onnx rewritten for serving: %s", ", ".join(done))
    return done


def _export_precision(staging: Path, config: MHAConfig, weights: Weights, precision: str) -> ParityReport:
    """model.<precision>.onnx, verified on ONNX Runtime (CPU) within the format's tolerance."""
    path = staging / precision_file(precision)
    model = build_precision_graph(config, weights, precision)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    tolerance = precision_tolerance(precision, config)
    log.info("checking %s on ONNX Runtime (CPU), tolerance %.1e", path.name, tolerance)
    try:
        runner = ort_cpu_runner(path)
    except Exception as exc:  # ORT's own error types: e.g. no CPU kernel for bf16 MatMul
        raise ExportError(
            f"ONNX Runtime here cannot run {path.name} ({str(exc)[:200]}); export {precision} where a runtime "
            "with its kernels (a CUDA device) can verify it"
        ) from exc
    report = check_parity(runner, config, weights, parity_grid(config.max_seq_len), tolerance=tolerance)
    if not report.ok:
        raise ParityError(report)
    return report


def _export_step(staging: Path, config: MHAConfig, weights: Weights, tolerance: float) -> ParityReport | None:
    """The step graphs for a causal model, verified on their (B, past, t) grid; None for a
    non-causal one."""
    if not config.causal:
        return None
    paths = (staging / STEP_PROJECT_FILE, staging / STEP_ATTEND_FILE)
    export_step_graphs(config, weights, paths)
    grid = step_parity_grid(config.max_seq_len)
    log.info("checking the step graphs on ONNX Runtime (CPU) over %d (B, past, t) shapes", len(grid))
    report = check_step_parity(ort_step_runner(*paths), config, weights, grid, tolerance=tolerance)
    if not report.ok:
        raise ParityError(report)
    return report


def _manifest(
    staging: Path,
    config: MHAConfig,
    opset: int,
    graph: str,
    report: ParityReport,
    step_report: ParityReport | None,
    files: list[str],
) -> dict[str, object]:
    step = {
        "project": {"file": STEP_PROJECT_FILE, "inputs": [INPUT_NAME], "outputs": list(PROJECTED_NAMES)},
        "attend": {
            "file": STEP_ATTEND_FILE,
            "inputs": [PROJECTED_NAMES[0], *CACHE_NAMES, PAST_LENGTH_NAME],
            "outputs": [OUTPUT_NAME],
        },
    }
    return {
        "format": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config.to_dict(),
        "opset": opset,
        "graph": graph,
        "input": {"name": INPUT_NAME, "datatype": "FP32", "shape": ["batch", "seq", config.d_model]},
        "output": {"name": OUTPUT_NAME, "datatype": "FP32", "shape": ["batch", "seq", config.d_model]},
        "files": {
            name: {"sha256": sha256_file(staging / name), "bytes": (staging / name).stat().st_size} for name in files
        },
        "versions": {
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "onnxscript": version("onnxscript"),
        },
        "parity": report.to_dict(),
        **({"step": step, "step_parity": step_report.to_dict()} if step_report is not None else {}),
    }
