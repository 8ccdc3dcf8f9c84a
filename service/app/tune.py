"""`mha tune`: the settings that serve the most requests per second with p99 under the operator's
target, measured on this machine with the operator's shapes.

Each candidate is a full `mha serve` started here on free loopback ports, driven by the project's
load generator (`service/client/loadgen.py`, what `mha bench` runs) at each concurrency, once on
one shared channel and once with a connection per client; a load point counts the worse of the
two (the fewer requests per second, the higher p99), so that the settings serve both kinds of
client. A candidate's score is its most requests per second at a point whose p99 meets the target.

The search is coordinate descent from the defaults, never the whole grid: one setting at a time,
most influential first (workers, backend, batch size, batching delay, threads, precision), each of
its values tried with the others at the best so far, the best kept; passes repeat while one
improves and the budget lasts. The time the final check needs is kept aside from the start.
The winner is then measured again beside the defaults, interleaved, round by round.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from service.app.launch import ServerProcess
from service.client.loadgen import CONNECTIONS, LoadResult, run_load

log = logging.getLogger(__name__)

Shape = tuple[int, int, int]
ENV_NAMES = {
    "backend": "MHA_BACKEND",
    "workers": "MHA_WORKERS",
    "max_batch_size": "MHA_MAX_BATCH_SIZE",
    "max_queue_delay_ms": "MHA_MAX_QUEUE_DELAY_MS",
    "threads": "MHA_THREADS",
    "precision": "MHA_PRECISION",
}


class TuneError(RuntimeError):
    """`mha tune` cannot go on; the message says why and what to do. `code`: the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Candidate:
    """One set of settings; `workers` 0 means `auto`, as `mha serve` picks with no flag."""

    backend: str = "auto"
    workers: int = 0
    max_batch_size: int = 8
    max_queue_delay_ms: float = 2.0
    threads: int = 0
    precision: str = "fp32"

    def settings(self) -> dict[str, str]:
        values = {**asdict(self), "workers": self.workers or "auto"}
        return {name: f"{values[name]:g}" if isinstance(values[name], float) else str(values[name]) for name in values}

    def args(self) -> list[str]:
        return [arg for name, value in self.settings().items() for arg in (f"--{name.replace('_', '-')}", value)]

    def label(self) -> str:
        s = self.settings()
        return (
            f"{s['backend']}, {s['workers']} workers, batch {s['max_batch_size']}, "
            f"delay {s['max_queue_delay_ms']} ms, {s['threads']} threads, {s['precision']}"
        )


@dataclass(frozen=True)
class Point:
    """One load point: the worse of the two connection modes at one concurrency."""

    concurrency: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float


@dataclass
class Measured:
    candidate: Candidate
    points: list[Point] = field(default_factory=list)
    error: str = ""  # why it could not be measured (it did not start, or its requests failed)

    def score(self, target_ms: float) -> float | None:
        """The most req/s at a point within the target; None when none is."""
        within = [p.throughput_rps for p in self.points if p.p99_ms <= target_ms]
        return max(within) if within else None

    def best_point(self, target_ms: float) -> Point | None:
        """The point the score comes from; without one within the target, the lowest p99."""
        within = [p for p in self.points if p.p99_ms <= target_ms]
        if within:
            return max(within, key=lambda p: p.throughput_rps)
        return min(self.points, key=lambda p: p.p99_ms) if self.points else None

    def closest_p99_ms(self) -> float:
        """The lowest p99 it reached (inf when nothing was measured)."""
        return min((p.p99_ms for p in self.points), default=float("inf"))

    def row(self, target_ms: float) -> dict[str, object]:
        best = self.best_point(target_ms)
        return {
            "settings": self.candidate.settings(),
            "points": [asdict(p) for p in self.points],
            "meets_target": self.score(target_ms) is not None,
            "best": asdict(best) if best is not None else None,
            "error": self.error,
        }


def dimensions(
    cpus: int, auto_workers: int, backends: Sequence[str], precisions: Sequence[str]
) -> list[tuple[str, list[object]]]:
    """Each setting's values, most influential first. `auto_workers`: the count `--workers auto`
    starts here (one per GPU on a GPU host, else one per CPU), which `auto` (0) already measures."""
    workers = sorted({1, max(1, cpus // 2)} - {auto_workers})
    return [
        ("workers", [0, *workers]),
        ("backend", ["auto", *backends]),
        ("max_batch_size", [1, 4, 8, 16, 32]),
        ("max_queue_delay_ms", [0.0, 1.0, 2.0, 5.0]),
        ("threads", [*sorted({0, 1, max(1, cpus // 2)})]),
        ("precision", list(precisions)),
    ]


def neighbours(best: Candidate, dims: Sequence[tuple[str, list[object]]]) -> Iterator[Candidate]:
    """The candidates one setting away from `best`, setting by setting in the order of `dims`."""
    for name, values in dims:
        for value in values:
            if value != getattr(best, name):
                changed: dict[str, Any] = {name: value}
                yield replace(best, **changed)


MIN_GAIN = 0.03  # what a candidate must gain over the best so far to replace it: more than noise


def better(a: Measured, b: Measured, target_ms: float) -> bool:
    """Is `a` better than `b` by more than MIN_GAIN: more req/s within the target, or, neither
    within it, a lower p99?"""
    a_score, b_score = a.score(target_ms), b.score(target_ms)
    if a_score is not None and b_score is not None:
        return a_score > b_score * (1 + MIN_GAIN)
    if a_score is None and b_score is None:
        return a.closest_p99_ms() < b.closest_p99_ms() * (1 - MIN_GAIN)
    return a_score is not None


def worse_of(results: Sequence[LoadResult]) -> Point:
    """One concurrency's point from its runs in each connection mode: the fewer req/s, the higher p99."""
    return Point(
        concurrency=results[0].concurrency,
        throughput_rps=min(r.throughput_rps for r in results),
        p50_ms=max(r.p50_ms for r in results),
        p99_ms=max(r.p99_ms for r in results),
    )


@dataclass(frozen=True)
class Request:
    """What the operator asked, checked."""

    model_dir: Path
    shapes: list[Shape]
    target_ms: float
    concurrency: list[int]
    seconds: float
    budget_s: float
    rounds: int = 3
    out: Path = Path("tune")
    grpc_port: int = 0


@dataclass(frozen=True)
class Confirmation:
    settings: dict[str, str]  # the search's choice, measured again beside the defaults
    concurrency: int
    rounds: list[dict[str, float]]  # per round: chosen and default req/s and p99

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds)

    def ratio(self, key: str) -> float:
        default = self.median(f"default_{key}")
        return self.median(f"chosen_{key}") / default if default else float("nan")

    def holds(self, target_ms: float) -> bool:
        """Does the search's choice still beat the defaults, measured beside them? Within the
        target where they are not; both within it, more req/s by more than MIN_GAIN; neither, a
        p99 lower by more than MIN_GAIN. One noisy point in the search must not change a fleet."""
        chosen_within = self.median("chosen_p99_ms") <= target_ms
        if chosen_within != (self.median("default_p99_ms") <= target_ms):
            return chosen_within
        if chosen_within:
            return self.ratio("rps") > 1 + MIN_GAIN
        return self.ratio("p99_ms") < 1 - MIN_GAIN


Progress = Callable[[str], None]


class Tuner:
    """Measures candidates on servers it starts, within a time budget."""

    def __init__(self, request: Request, progress: Progress | None = None) -> None:
        self.request = request
        self.progress = progress or (lambda line: None)
        self.start_s = 10.0  # a server's start, until one is timed
        self.measured: dict[Candidate, Measured] = {}

    def cost_s(self) -> float:
        """What measuring one more candidate is expected to take."""
        return self.start_s + len(self.request.concurrency) * len(CONNECTIONS) * (self.request.seconds + 0.5)

    def server(self, candidate: Candidate, port: int | None = None) -> ServerProcess:
        args = ["--model-dir", str(self.request.model_dir), *candidate.args()]
        chosen = self.request.grpc_port if port is None else port
        return ServerProcess(args, env={"MHA_LOG_LEVEL": "WARNING"}, grpc_port=chosen)

    def started(self, candidate: Candidate, log_dir: Path, port: int | None = None) -> ServerProcess:
        server, began = self.server(candidate, port), time.monotonic()
        try:
            server.start(log_dir / f"server-{len(self.measured)}-{port or 0}.log", ready_timeout=300, tied=True)
        except (RuntimeError, TimeoutError) as exc:
            server.stop()
            last = server.log().strip().splitlines()[-1:] or ["(no output)"]
            raise TuneError(f"{candidate.label()}: the server did not start ({exc}): {last[0][:300]}", 1) from exc
        self.start_s = time.monotonic() - began
        return server

    def load(self, url: str, concurrency: Sequence[int] = ()) -> list[Point]:
        """Each concurrency (the request's by default) in each connection mode, the worse mode kept."""
        points, r = [], self.request
        for clients in concurrency or r.concurrency:
            runs = []
            for mode in CONNECTIONS:
                result = run_load(url, clients, r.seconds, [], shapes=r.shapes, own_connection=mode == "per-client")
                if result.stopped or not result.requests:
                    raise TuneError(f"the requests failed: {result.stopped or result.errors}", 1)
                runs.append(result)
            points.append(worse_of(runs))
        return points

    def measure(self, candidate: Candidate, log_dir: Path) -> Measured:
        if candidate in self.measured:
            return self.measured[candidate]
        measured = Measured(candidate)
        self.measured[candidate] = measured
        try:
            server = self.started(candidate, log_dir)
        except TuneError as exc:
            measured.error = str(exc)
            return measured
        try:
            measured.points = self.load(server.url)
        except TuneError as exc:
            measured.error = str(exc)
        finally:
            server.stop()
        return measured

    def best(self) -> Measured:
        """The best measured so far: a later candidate replaces an earlier one (the defaults
        first) only when it is better by more than MIN_GAIN, so that noise changes nothing."""
        candidates = [m for m in self.measured.values() if m.points]
        if not candidates:
            errors = "; ".join(m.error for m in self.measured.values())[:600]
            raise TuneError(f"no candidate could be measured: {errors}", 1)
        best = candidates[0]
        for measured in candidates[1:]:
            if better(measured, best, self.request.target_ms):
                best = measured
        return best

    def search(
        self, dims: Sequence[tuple[str, list[object]]], deadline: Callable[[], float], log_dir: Path
    ) -> Measured:
        """Coordinate descent from the defaults until no setting improves or the time is up
        (`deadline()`: when the search must stop, as the costs become known)."""
        self.progress(f"measuring the defaults: {Candidate().label()}")
        self.measure(Candidate(), log_dir)
        improved = True
        while improved and time.monotonic() + self.cost_s() <= deadline():
            improved, start = False, self.best()
            for candidate in neighbours(start.candidate, dims):
                if time.monotonic() + self.cost_s() > deadline():
                    break
                if candidate in self.measured:
                    continue
                best, target = self.best(), self.request.target_ms
                said = _point_said(best, target)
                self.progress(f"[{len(self.measured) + 1}] {candidate.label()} | best so far: {said}")
                if better(self.measure(candidate, log_dir), best, target):
                    improved = True
        return self.best()

    def confirm(self, chosen: Measured, log_dir: Path) -> Confirmation:
        """The chosen settings and the defaults, both serving, measured in turn at the chosen
        point's concurrency, round by round (the order alternating)."""
        point, rounds = chosen.best_point(self.request.target_ms), self.request.rounds
        assert point is not None, "a chosen candidate was measured"
        servers: dict[str, ServerProcess] = {}
        results = []
        try:
            servers["chosen"] = self.started(chosen.candidate, log_dir, self.request.grpc_port or None)
            servers["default"] = self.started(Candidate(), log_dir, 0)
            for n in range(rounds):
                order = ("chosen", "default") if n % 2 == 0 else ("default", "chosen")
                self.progress(f"confirming: round {n + 1} of {rounds}")
                row: dict[str, float] = {}
                for name in order:
                    (measured,) = self.load(servers[name].url, [point.concurrency])
                    row[f"{name}_rps"], row[f"{name}_p99_ms"] = measured.throughput_rps, measured.p99_ms
                results.append(row)
        finally:
            for server in servers.values():
                server.stop()
        return Confirmation(chosen.candidate.settings(), point.concurrency, results)


def progress_line(out: TextIO | None = None) -> Progress:
    """One line per step on stderr, redrawn in place on a terminal."""
    stream = out or sys.stderr
    terminal = stream.isatty()

    def show(line: str) -> None:
        stream.write(("\r\x1b[2K" if terminal else "") + line[:160] + ("" if terminal else "\n"))
        stream.flush()

    return show


def _confirmation_row(confirmation: Confirmation | None, target_ms: float) -> dict[str, object] | None:
    if confirmation is None:
        return None
    ratios = {"rps_ratio": confirmation.ratio("rps"), "p99_ratio": confirmation.ratio("p99_ms")}
    return {**asdict(confirmation), **ratios, "holds": confirmation.holds(target_ms)}


def write_results(
    request: Request, measured: Sequence[Measured], chosen: Measured, confirmation: Confirmation | None
) -> list[Path]:
    """config.env, candidates.json, candidates.md and pareto.png in the request's `out`."""
    from service.app.tune_report import config_env, markdown, plot

    out = request.out
    out.mkdir(parents=True, exist_ok=True)
    target, rows = request.target_ms, [m.row(request.target_ms) for m in measured]
    summary = {
        "target_p99_ms": target,
        "shapes": request.shapes,
        "chosen": chosen.row(target),
        "meets_target": chosen.score(target) is not None,
        "confirmation": _confirmation_row(confirmation, target),
        "candidates": rows,
    }
    paths = [out / "config.env", out / "candidates.json", out / "candidates.md", out / "pareto.png"]
    paths[0].write_text(config_env(chosen.candidate.settings(), ENV_NAMES, summary))
    paths[1].write_text(json.dumps(summary, indent=1) + "\n")
    paths[2].write_text(markdown(summary))
    plot(summary, paths[3])
    return paths


def parse_shapes(texts: Sequence[str]) -> list[Shape]:
    """Each --shape: B,T,C, or several such triples in one list."""
    shapes = []
    for text in texts:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError as exc:
            raise TuneError(f"--shape {text[:40]!r}: expected B,T,C, integers such as 4,512,128") from exc
        if not values or len(values) % 3:
            raise TuneError(f"--shape {text[:40]!r}: expected B,T,C (or several: B,T,C,B,T,C)")
        shapes += [(values[i], values[i + 1], values[i + 2]) for i in range(0, len(values), 3)]
    return shapes


def checked_model(model_dir: Path, shapes: Sequence[Shape]) -> list[str]:
    """The precisions the model's directory holds, or why it cannot be served or
    cannot serve `shapes`. What needs no PyTorch is checked first: the weights are there, and the
    shapes fit the config the manifest records (which the weights are then checked against)."""
    from export.layout import MANIFEST_FILE, ModelFiles

    files = ModelFiles(model_dir)
    if not files.weights.is_file():
        raise TuneError(f"--model-dir {model_dir}: no exported model there; export one with `mha export --out DIR`")
    manifest: Any = None
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):  # unreadable: the checks below say why
        manifest = json.loads((model_dir / MANIFEST_FILE).read_text())
        check_shapes(shapes, int(manifest["config"]["d_model"]), int(manifest["config"]["max_seq_len"]))
    from export.verify import check_manifest, sha256_file
    from model.checkpoint import CheckpointError, load_checkpoint

    try:
        config, _ = load_checkpoint(files.weights)
    except CheckpointError as exc:
        raise TuneError(f"--model-dir {model_dir} fails its checks: {exc}") from exc
    if problems := check_manifest(files, config, sha256_file(files.weights)):
        raise TuneError(f"--model-dir {model_dir} fails its checks: {'; '.join(problems)}; re-export it")
    check_shapes(shapes, config.d_model, config.max_seq_len)
    return list(manifest.get("precisions", {"fp32": {}}))  # read, as check_manifest found it


def check_request(request: Request) -> None:
    """Refuse, before the model is read or anything starts, what cannot be measured."""
    if not 0 < request.target_ms < math.inf:
        raise TuneError(f"--p99-ms {request.target_ms:g}: impossible; give a finite latency target in ms above 0")
    finite = all(0 < value < math.inf for value in (request.seconds, request.budget_s))  # nan and inf parse
    if min(request.concurrency) < 1 or not finite or request.rounds < 3:
        raise TuneError("--concurrency, --seconds and --budget-s must be positive and finite, and --rounds at least 3")
    points = len(request.concurrency) * len(CONNECTIONS)
    least_s = points * request.seconds  # the defaults' load alone, no start counted
    if request.budget_s < least_s:
        raise TuneError(
            f"--budget-s {request.budget_s:g}: measuring even the defaults takes at least {least_s:g} s "
            f"({len(request.concurrency)} concurrency points x {len(CONNECTIONS)} connection modes x --seconds "
            f"{request.seconds:g}), and the search and its confirmation more: give a larger --budget-s, or fewer "
            "--concurrency points or --seconds"
        )
    if request.grpc_port:
        from service.app.preflight import StartupError, check_port

        try:
            check_port("127.0.0.1", request.grpc_port, "--grpc-port")
        except StartupError as exc:
            raise TuneError(str(exc)) from exc


def check_shapes(shapes: Sequence[Shape], d_model: int, max_seq_len: int) -> None:
    """Refuse a shape the model cannot serve."""
    for b, t, c in shapes:
        if c != d_model or not 1 <= t <= max_seq_len or not 1 <= b <= MAX_ROWS:
            raise TuneError(
                f"--shape {b},{t},{c}: this model serves C = {d_model}, 1 <= T <= {max_seq_len} and "
                f"1 <= B <= {MAX_ROWS}"
            )


MAX_ROWS = 256  # mha serve's --max-request-rows default: the largest B one request may carry


def backends_here() -> list[str]:
    from service.app.supervisor import gpu_devices

    return ["ort-cuda", "ort-cpu", "torch"] if gpu_devices() else ["ort-cpu", "torch"]


def tune(request: Request, progress: Progress | None = None) -> int:
    """Search, confirm, write; 0 when the chosen settings meet the target, 1 when none does."""
    from service.app.supervisor import workers_to_start
    from service.resources import available_cpus
    from service.settings import Settings

    check_request(request)
    if request.out.exists() and not request.out.is_dir():
        raise TuneError(f"--out {request.out}: cannot write the results there (it is a file, not a folder)")
    precisions = checked_model(request.model_dir, request.shapes)
    began = time.monotonic()
    tuner = Tuner(request, progress or progress_line())
    points_per_round = 2 * len(CONNECTIONS) * (request.seconds + 0.5)

    def deadline() -> float:  # the confirmation's time kept aside
        return began + request.budget_s - 2 * tuner.start_s - request.rounds * points_per_round

    logs = request.out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TuneError(f"--out {request.out}: cannot write the results there ({exc.strerror})") from exc
    auto = workers_to_start(Settings(model_dir=request.model_dir))  # the defaults' count: not searched again
    dims = dimensions(available_cpus(), auto, backends_here(), precisions)
    searched = tuner.search(dims, deadline, logs)
    confirmation = tuner.confirm(searched, logs) if searched.candidate != Candidate() else None
    chosen = settle(searched, tuner.measured[Candidate()], confirmation, request.target_ms)
    paths = write_results(request, list(tuner.measured.values()), chosen, confirmation)
    tuner.progress(f"done: {len(tuner.measured)} candidates in {time.monotonic() - began:.0f} s")
    said = verdict(request.target_ms, searched, chosen, confirmation)
    sys.stdout.write(said + f"wrote {', '.join(str(p) for p in paths)}\n")
    return 0 if chosen.score(request.target_ms) is not None else 1


def settle(searched: Measured, defaults: Measured, confirmation: Confirmation | None, target_ms: float) -> Measured:
    """What config.env gets: the search's choice if measuring it beside the defaults confirmed it
    (or the defaults could not be measured), else the defaults."""
    if confirmation is None or confirmation.holds(target_ms) or not defaults.points:
        return searched
    return defaults


def verdict(target_ms: float, searched: Measured, chosen: Measured, confirmation: Confirmation | None) -> str:
    """What the run found, ending with what config.env holds and the point it was measured at."""
    lines = []
    if confirmation is not None:
        lines.append(f"the search's best: {searched.candidate.label()} ({_point_said(searched, target_ms)})")
        lines.append(
            f"against the defaults, {len(confirmation.rounds)} interleaved rounds: "
            f"{confirmation.ratio('rps'):.2f}x the req/s, {confirmation.ratio('p99_ms'):.2f}x the p99"
            + ("" if chosen is searched else ": not better, so config.env keeps the defaults")
        )
    else:
        lines.append("the defaults measured best: nothing to change")
    said = f"{chosen.candidate.label()} ({_point_said(chosen, target_ms)})"
    if chosen.score(target_ms) is None:
        lines.append(f"no candidate meets p99 <= {target_ms:g} ms; the closest: {said}")
    else:
        lines.append(f"chosen: {said}")
    return "\n".join(lines) + "\n"


def _point_said(measured: Measured, target_ms: float) -> str:
    point = measured.best_point(target_ms)
    assert point is not None, "a chosen candidate was measured"
    return f"{point.throughput_rps:.0f} req/s, p99 {point.p99_ms:.2f} ms at {point.concurrency} clients"
