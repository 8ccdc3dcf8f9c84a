"""Parity of an ONNX Runtime session against the two float64 references."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from export.grid import parity_grid
from export.layout import (
    CACHE_NAMES,
    INPUT_NAME,
    MANIFEST_FILE,
    MODEL_FILE,
    OUTPUT_NAME,
    PAST_LENGTH_NAME,
    PROJECTED_NAMES,
    WEIGHTS_FILE,
    ModelFiles,
)
from model import MHAConfig
from model.checkpoint import Weights, load_checkpoint
from model.reference import attention_einsum, attention_view, relative_error

log = logging.getLogger(__name__)

TOLERANCE = 1e-5  # ||y - ref|| / ||ref||, float32 against float64

Runner = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ParityRow:
    batch: int
    seq: int  # T; for a step, the new tokens t
    rel_view: float
    rel_einsum: float
    abs_view: float
    abs_einsum: float
    past: int | None = None  # a decode step: the tokens before the new ones

    @property
    def worst(self) -> float:
        """The larger error; NaN when either is (max() keeps a NaN only in first place)."""
        errors = (self.rel_view, self.rel_einsum)
        return math.nan if any(math.isnan(e) for e in errors) else max(errors)

    def within(self, tolerance: float) -> bool:
        return self.worst <= tolerance  # False for NaN


@dataclass
class ParityReport:
    tolerance: float
    rows: list[ParityRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """The problems, then every row off by more than the tolerance, or not finite."""
        over = [r for r in self.rows if not r.within(self.tolerance)]
        return self.problems + [f"(B={r.batch}, T={r.seq}) off by {r.worst:.2e} > {self.tolerance:.1e}" for r in over]

    def to_dict(self) -> dict[str, object]:
        return {"tolerance": self.tolerance, "ok": self.ok, "grid": [asdict(r) for r in self.rows]}

    def table(self) -> str:
        lines = [f"{'B':>3} {'T':>6} {'past':>6} {'rel(view)':>11} {'rel(einsum)':>11} {'max|abs|':>10}  result"]
        for r in self.rows:
            verdict = "ok" if r.within(self.tolerance) else "FAIL"
            past = "-" if r.past is None else str(r.past)
            lines.append(
                f"{r.batch:>3} {r.seq:>6} {past:>6} {r.rel_view:>11.2e} {r.rel_einsum:>11.2e} "
                f"{max(r.abs_view, r.abs_einsum):>10.2e}  {verdict}"
            )
        lines += [f"problem: {p}" for p in self.problems]
        lines.append(f"{'PASS' if self.ok else 'FAIL'}: tolerance {self.tolerance:.0e} relative")
        return "\n".join(lines)


def step_parity_grid(max_seq_len: int) -> list[tuple[int, int, int]]:
    """(B, past, t) triples: past = 0, t = 1, chunks, and past + t = max_seq_len."""
    L = max_seq_len
    triples = [(1, 0, 1), (2, 0, min(5, L)), (1, 1, 1), (3, min(13, L - 1), 1), (2, L // 2, min(7, L - L // 2))]
    triples += [(1, L - 1, 1), (4, max(0, L - 16), min(16, L))]
    return list(dict.fromkeys((b, min(p, L - 1), max(1, min(t, L - min(p, L - 1)))) for b, p, t in triples))


StepRunner = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def check_step_parity(
    run: StepRunner,
    config: MHAConfig,
    weights: Weights,
    grid: Sequence[tuple[int, int, int]],
    seed: int = 0,
    tolerance: float = TOLERANCE,
) -> ParityReport:
    """A step graph given the past keys and values of a random prefix: its y against the last t rows
    of both references over the whole prefix, and its present keys and values against the
    projections of the whole prefix."""
    from model import MultiHeadAttention

    module = MultiHeadAttention.from_weights(config, weights)
    report = ParityReport(tolerance=tolerance)
    gen = torch.Generator().manual_seed(seed)
    for batch, past, new in grid:
        prefix = torch.randn(batch, past + new, config.d_model, generator=gen)  # (B, past + t, C)
        with torch.no_grad():
            _, keys, values = module.project(prefix)  # (B, nh, past + t, hs)
        inputs = (prefix[:, past:].numpy(), keys[:, :, :past].numpy(), values[:, :, :past].numpy())
        y, present_key, present_value = (torch.from_numpy(np.array(a, dtype=np.float64)) for a in run(*inputs))
        cache_errors = (relative_error(present_key, keys), relative_error(present_value, values))
        if not all(e <= tolerance for e in cache_errors):  # NaN included
            worst = f"{cache_errors[0]:.2e} / {cache_errors[1]:.2e}"
            report.problems.append(f"(B={batch}, past={past}, t={new}): present keys / values off by {worst}")
        ref_v = attention_view(prefix, weights, config)[:, past:]
        ref_e = attention_einsum(prefix, weights, config)[:, past:]
        report.rows.append(_row(batch, new, y, ref_v, ref_e, past))
    return report


def _row(
    batch: int, seq: int, y: torch.Tensor, ref_v: torch.Tensor, ref_e: torch.Tensor, past: int | None
) -> ParityRow:
    return ParityRow(
        batch=batch,
        seq=seq,
        rel_view=relative_error(y, ref_v),
        rel_einsum=relative_error(y, ref_e),
        abs_view=(y - ref_v).abs().max().item(),
        abs_einsum=(y - ref_e).abs().max().item(),
        past=past,
    )


def ort_step_runner(project_path: Path, attend_path: Path) -> StepRunner:
    """The step graphs on ORT-CPU as a server runs them: the past placed in a cache with room to
    spare, filled beyond with values the mask must hide; the new keys and values written into
    it; attention over the whole cache. Returns y and the cache's first past + t positions."""
    import onnxruntime as ort

    project, attend = (
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (project_path, attend_path)
    )
    spare = np.random.default_rng(0)

    def run(x: np.ndarray, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        (B, nh, P, hs), t = keys.shape, x.shape[1]
        caches = [spare.standard_normal((B, nh, P + t + 5, hs), dtype=np.float32) for _ in range(2)]
        q, k, v = project.run(list(PROJECTED_NAMES), {INPUT_NAME: x})  # (B, nh, t, hs) each
        for cache, past, new in zip(caches, (keys, values), (k, v), strict=True):
            cache[:, :, :P], cache[:, :, P : P + t] = past, new
        feeds = {PROJECTED_NAMES[0]: q, PAST_LENGTH_NAME: np.array(P, np.int64)}
        feeds.update(zip(CACHE_NAMES, caches, strict=True))
        (y,) = attend.run([OUTPUT_NAME], feeds)
        return y, caches[0][:, :, : P + t], caches[1][:, :, : P + t]

    return run


def check_parity(
    run: Runner,
    config: MHAConfig,
    weights: Weights,
    grid: Sequence[tuple[int, int]],
    seed: int = 0,
    tolerance: float = TOLERANCE,
) -> ParityReport:
    """Run `run` on seeded random inputs for every (B, T) and compare with both references."""
    return check_parity_of({"": run}, config, weights, grid, seed, tolerance)[""]


def parity_inputs(config: MHAConfig, grid: Sequence[tuple[int, int]], seed: int = 0) -> Iterator[torch.Tensor]:
    """The seeded standard-normal inputs the parity checks send, one (B, T, C) tensor per (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    for batch, seq in grid:
        yield torch.randn(batch, seq, config.d_model, generator=gen)  # (B, T, C)


def check_parity_of(
    runs: Mapping[str, Runner],
    config: MHAConfig,
    weights: Weights,
    grid: Sequence[tuple[int, int]],
    seed: int = 0,
    tolerance: float = TOLERANCE,
    refusals: tuple[type[Exception], ...] = (),
) -> dict[str, ParityReport]:
    """check_parity for several runners on the same inputs, the references computed once a shape.
    A runner that raises one of `refusals` is reported refused, with the exception's words, and
    not run again."""
    reports = {name: ParityReport(tolerance=tolerance) for name in runs}
    refused: set[str] = set()
    for x in parity_inputs(config, grid, seed):
        batch, seq = x.shape[0], x.shape[1]
        answers = {}
        for name, run in runs.items():
            if name in refused:
                continue
            try:
                answers[name] = torch.from_numpy(np.array(run(x.numpy()), dtype=np.float64))  # a writable copy
            except refusals as exc:
                reports[name].problems.append(f"refused: {exc}")
                refused.add(name)
        for name, y in list(answers.items()):
            if tuple(y.shape) != tuple(x.shape):
                shapes = f"output shape {tuple(y.shape)}, expected {tuple(x.shape)}"
                reports[name].problems.append(f"(B={batch}, T={seq}): {shapes}")
                del answers[name]
        if answers:
            ref_v, ref_e = attention_view(x, weights, config), attention_einsum(x, weights, config)
            for name, y in answers.items():
                row = _row(batch, seq, y, ref_v, ref_e, None)
                log.debug("parity %s B=%d T=%d rel(view)=%.2e", name, batch, seq, row.rel_view)
                reports[name].rows.append(row)
    for report in reports.values():
        if not all(math.isfinite(r.worst) for r in report.rows):
            report.problems.append(
                "the output is not finite (NaN or inf) for standard-normal inputs: the weights overflow the graph's "
                "arithmetic; scale them down"
            )
    return reports


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ort_cpu_runner(model_path: Path, threads: int = 0) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {INPUT_NAME: x})[0]

    return run


def verify_model_dir(directory: Path, grid: Sequence[tuple[int, int]] | None = None, seed: int = 1) -> ParityReport:
    """Re-check a model directory: files, hashes, then parity on ORT-CPU over a grid.

    The default seed differs from export's, so verification sees inputs export never used.
    """
    files = ModelFiles(Path(directory))
    weights_sha256 = sha256_file(files.weights) if files.weights.is_file() else ""
    problems = _check_files(files, weights_sha256)  # before loading: a damaged file is named, not loaded
    if problems:
        return ParityReport(tolerance=TOLERANCE, problems=problems)
    config, weights = load_checkpoint(files.weights)
    problems = _content_problems(files, config)
    if problems:
        return ParityReport(tolerance=TOLERANCE, problems=problems)
    shapes = grid if grid is not None else parity_grid(config.max_seq_len)
    report = check_parity(ort_cpu_runner(directory / MODEL_FILE), config, weights, shapes, seed=seed)
    if all(path.is_file() for path in files.steps):
        steps = check_step_parity(ort_step_runner(*files.steps), config, weights, step_parity_grid(config.max_seq_len))
        report.rows += steps.rows
        report.problems += steps.problems
    for precision, entry in json.loads(files.manifest.read_text()).get("precisions", {}).items():
        if precision != "fp32":
            half = check_parity(
                ort_cpu_runner(directory / entry["file"]), config, weights, shapes, seed, entry["tolerance"]
            )
            report.problems += [f"{entry['file']}: {row}" for row in half.failures()]
    return report


def check_manifest(files: ModelFiles, config: MHAConfig, weights_sha256: str) -> list[str]:
    """What manifest.json does not vouch for: each file's sha256 (the weights' hashed by the caller,
    who needs it too), the config of the weights (as loaded: `config`), and the ONNX graph's
    tensors. Empty when the directory is as exported."""
    return _check_files(files, weights_sha256) or _content_problems(files, config)


def _content_problems(files: ModelFiles, config: MHAConfig) -> list[str]:
    """The config and the graph against the manifest; its hashes already matched."""
    manifest = json.loads(files.manifest.read_text())
    problems = []
    if manifest.get("config") != config.to_dict():
        problems.append(f"the weights' config {config.to_dict()} differs from the manifest's {manifest.get('config')}")
    return problems + _graph_problems(files, config)


def _graph_problems(files: ModelFiles, config: MHAConfig) -> list[str]:
    import onnx

    try:
        graph = onnx.load(str(files.onnx), load_external_data=False).graph
    except Exception as exc:  # a damaged file: say so, whatever onnx raised
        return [f"{MODEL_FILE} cannot be read as ONNX: {type(exc).__name__}"]
    problems = []
    for values, name in ((graph.input, INPUT_NAME), (graph.output, OUTPUT_NAME)):
        dims = [[d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in values if v.name == name]
        if dims != [["batch", "seq", config.d_model]]:
            problems.append(
                f"{MODEL_FILE}: tensor {name!r} is {dims or 'missing'}; expected [batch, seq, {config.d_model}]"
            )
    return problems


def _check_files(files: ModelFiles, weights_sha256: str) -> list[str]:
    directory = files.directory
    missing = [n for n in (MODEL_FILE, WEIGHTS_FILE, MANIFEST_FILE) if not (directory / n).is_file()]
    if missing:
        return [f"{directory}: missing {missing}"]
    try:
        manifest = json.loads(files.manifest.read_text())
    except json.JSONDecodeError as exc:
        return [f"{MANIFEST_FILE} is not valid JSON: {exc}"]
    if not isinstance(manifest, dict):
        return [f"{MANIFEST_FILE} is not a JSON object"]
    problems = []
    hashed = [(MODEL_FILE, sha256_file(files.onnx)), (WEIGHTS_FILE, weights_sha256)]
    for name in manifest.get("files", {}):  # the step graph and half-precision graphs, where exported
        if name not in (MODEL_FILE, WEIGHTS_FILE):
            path = directory / name
            hashed.append((name, sha256_file(path) if path.is_file() and "/" not in name else "missing"))
    for name, actual in hashed:
        recorded = manifest.get("files", {}).get(name, {}).get("sha256")
        if recorded != actual:
            problems.append(f"{name}: sha256 {actual[:12]}... differs from the manifest's {str(recorded)[:12]}...")
    return problems
