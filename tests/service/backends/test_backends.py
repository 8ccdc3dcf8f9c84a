"""Backends: load, self-check, selection order and reasons, the run-time fallback chain."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from export.layout import ModelFiles
from model import MHAConfig
from model.attention import MultiHeadAttention
from model.checkpoint import init_weights, load_checkpoint
from model.reference import attention_view, relative_error
from service.backends.base import Backend, BackendLoadError
from service.backends.chain import BackendChain, LightRoute
from service.backends.ort import OrtCpuBackend, OrtCudaBackend
from service.backends.pytorch import ServedAttention, TorchBackend
from service.backends.selection import (
    LEAST_ROUNDS,
    PROBE_BUDGET_S,
    BackendSpec,
    SelfCheck,
    Timings,
    probe_rounds,
    probe_shapes,
    select_backends,
    speed_order,
    split_by_size,
)
from service.batching import BatchEvent, batch_mflop
from service.engine.publishing import Publisher, ServingBackends
from service.engine.readiness import DeviceHealth
from service.errors import BackendFailure, NotReady
from service.metrics import Metrics
from service.protocol.status import to_status
from service.tracing import Tracing
from tests.support import ManualClock


def test_cpu_backends_match_reference(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    x = np.random.default_rng(0).standard_normal((3, 41, 32), dtype=np.float32)
    ref = attention_view(torch.from_numpy(x), weights, config)
    for backend in (OrtCpuBackend(small_model_dir / "model.onnx", threads=1), TorchBackend(config, weights)):
        assert relative_error(torch.from_numpy(backend.run(x)), ref) < 1e-5, backend


def _nice(tid: int) -> int:
    """A thread's nice value, field 19 of its /proc stat line (counted after the command's ")")."""
    return int(Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_a_large_run_hands_its_arena_memory_back(small_model_dir: Path) -> None:
    """A batch of SHRINK_CELLS or more (rows x T x T) shrinks ORT's arena after its run, so that
    one large request leaves no gigabytes resident."""
    from service.backends.ort import SHRINK_CELLS

    backend = OrtCpuBackend(small_model_dir / "model.onnx", threads=2, width=32)
    rng = np.random.default_rng(5)
    small = rng.standard_normal((1, 4, 32), dtype=np.float32)
    large = rng.standard_normal((SHRINK_CELLS // 64**2, 64, 32), dtype=np.float32)  # (1024, 64, 32)
    assert backend.run_options(small) is None
    shrink = backend.run_options(large)
    assert shrink is not None and shrink.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    assert backend.run(large).shape == large.shape


@pytest.mark.parametrize(("causal", "bias"), [(True, True), (True, False), (False, True), (False, False)])
def test_the_served_torch_module_computes_what_the_reference_does(causal: bool, bias: bool) -> None:
    """ServedAttention projects q, k and v in one matmul: each of them, and the answer, is what
    the reference computes, with and without bias, causal or not, for batches of several rows."""
    config = MHAConfig(d_model=32, n_head=4, max_seq_len=64, causal=causal, bias=bias)
    weights = init_weights(config, seed=7)
    served = ServedAttention.from_weights(config, weights)
    plain = MultiHeadAttention.from_weights(config, weights)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((3, 19, 32), dtype=np.float32))  # (B, T, C)
    with torch.inference_mode():
        for fused, separate in zip(served.project(x), plain.project(x), strict=True):  # (B, nh, T, hs) each
            assert torch.allclose(fused, separate, rtol=1e-6, atol=1e-6)
        assert relative_error(served(x), attention_view(x, weights, config)) < 1e-5


def test_torch_cpu_runs_small_batches_on_one_thread_and_restores_the_pool(small_model_dir: Path) -> None:
    """Below the measured crossover a batch runs on one thread (on two, (1, 64, 128) cost twice
    the CPU for no gain); above it the pool; the setting is restored, and both stay exact."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    before = torch.get_num_threads()
    try:
        backend = TorchBackend(config, weights, threads=2)
        assert backend.single_max_tokens in (0, 1, 4, 16, 64, 256)
        backend.single_max_tokens = 16  # whatever was measured: both routes stay exact
        for shape in ((1, 16, 32), (1, 17, 32), (4, 61, 32)):
            x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
            reference = attention_view(torch.from_numpy(x), weights, config)
            assert relative_error(torch.from_numpy(backend.run(x)), reference) < 1e-5
            assert torch.get_num_threads() == 2  # restored after the one-thread route
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("medians", "limit"),
    [
        ({1: (40, 60), 4: (45, 60), 16: (60, 62), 64: (158, 150), 256: (1000, 500)}, 64),  # about equal: one thread
        ({1: (40, 60), 4: (45, 60), 16: (60, 62), 64: (158, 120)}, 16),  # the pool clearly faster at 64
        ({1: (90, 60)}, 0),  # the pool wins from the start
        ({1: (40, 60), 4: (45, 60), 16: (60, 62), 64: (100, 110), 256: (300, 250)}, 256),
    ],
)
def test_one_thread_is_kept_unless_the_pool_is_clearly_faster(medians: dict, limit: int) -> None:
    """The measured crossover keeps one thread within a 25% margin: before, a (1, 64, 128) that
    one thread computed in 158 us and the pool in 150 us went to the pool, and the limit varied
    0 to 256 from one start to the next."""
    from service.backends.crossover import single_thread_limit

    assert single_thread_limit(medians) == limit


def test_ort_cpu_runs_small_batches_single_threaded_below_a_measured_crossover(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    backend = OrtCpuBackend(small_model_dir / "model.onnx", threads=2, width=32)
    assert backend.single_max_tokens in (0, 1, 4, 16, 64, 256)
    backend.single_max_tokens = 16  # whatever was measured: both routes stay exact
    routes: list[str] = []
    for name in ("_single", "_session"):  # a spy on each real session: which one ran
        session = getattr(backend, name)
        session.run = lambda *a, _run=session.run, _name=name, **k: routes.append(_name) or _run(*a, **k)
    for shape in ((1, 16, 32), (1, 17, 32), (4, 61, 32)):
        x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
        reference = attention_view(torch.from_numpy(x), weights, config)
        assert relative_error(torch.from_numpy(backend.run(x)), reference) < 1e-5
    assert routes == ["_single", "_session", "_session"]
    assert OrtCpuBackend(small_model_dir / "model.onnx", threads=1, width=32)._single is None  # one thread, one session


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_ort_cuda_is_confirmed_not_assumed(small_model_dir: Path) -> None:
    """onnxruntime-gpu lists the CUDA provider even without a GPU; the backend must refuse."""
    with pytest.raises(
        BackendLoadError,
        match=r"ONNX Runtime did not enable the CUDA provider: session providers are \['CPUExecutionProvider'\]",
    ):
        OrtCudaBackend(small_model_dir / "model.onnx")


@pytest.mark.parametrize(
    ("torch_ms", "serving", "reason"),
    [
        (5.0, "torch-cpu", "(faster than ort-cpu by more than 25%)"),  # clearly faster: it serves
        (9.0, "ort-cpu", "(preferred; no other is faster by 25%)"),  # not by the margin: the preferred stays
        (12.0, "ort-cpu", "(preferred; no other is faster by 25%)"),
    ],
)
def test_auto_without_cuda_serves_the_clearly_faster_backend(
    small_model_dir: Path, torch_ms: float, serving: str, reason: str
) -> None:
    """What was measured decides, with the measurements given (ORT-CPU at 10 ms)."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    measured: list[list[str]] = []

    def measure(backends: list, config: MHAConfig) -> list[list[float]]:  # type: ignore[type-arg]
        measured.append([b.name for b in backends])
        shapes = len(probe_shapes(config))
        return [[{"ort-cpu": 10.0, "torch-cpu": torch_ms}[b.name]] * shapes for b in backends]

    files = ModelFiles(small_model_dir)
    selection = select_backends(BackendSpec(files.onnx, config, weights), "auto", cuda=False, measure=measure)
    assert measured == [["ort-cpu", "torch-cpu"]]  # both self-checked, measured once, ORT preferred
    names = [b.name for b in selection.backends]
    assert names[0] == serving and sorted(names) == ["ort-cpu", "torch-cpu"]
    reports = {c.name: c for c in selection.candidates}
    assert reports[serving].status == "serving" and reason in reports[serving].reason
    assert reports[names[1]].status == "fallback"
    assert reports["torch-cpu"].probe_ms == pytest.approx(torch_ms) and reports["ort-cpu"].probe_ms == pytest.approx(10)
    assert selection.light is None  # one backend wins every shape: one order serves all


def test_another_workers_timings_make_the_same_choices_without_measuring(small_model_dir: Path) -> None:
    """A worker given the timings another worker of its replica kept (as JSON, through a file)
    orders its backends by them, crossovers and decode steps included, and measures nothing."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    files = ModelFiles(small_model_dir)
    spec = BackendSpec(files.onnx, config, weights, step_paths=files.steps, threads=2)
    shapes = len(probe_shapes(config))

    def measure(backends: list, config: MHAConfig) -> list[list[float]]:  # type: ignore[type-arg]
        return [[{"ort-cpu": 10.0, "torch-cpu": 5.0}[b.name]] * shapes for b in backends]

    first = select_backends(spec, "auto", cuda=False, measure=measure)
    assert [b.name for b in first.backends] == ["torch-cpu", "ort-cpu"]  # torch clearly faster
    assert first.timings.probes == {"ort-cpu": [10.0] * shapes, "torch-cpu": [5.0] * shapes}
    assert set(first.timings.steps) == set(first.timings.one_thread) == {"ort-cpu", "torch-cpu"}
    kept = Timings.from_json(first.timings.to_json())
    assert kept == first.timings
    kept.steps = {"ort-cpu": 9.0, "torch-cpu": 1.0}  # not what a start measures: seen only if taken
    kept.one_thread = {"ort-cpu": 7, "torch-cpu": 9}

    def never(backends: list, config: MHAConfig) -> list[list[float]]:  # type: ignore[type-arg]
        raise AssertionError("measured again")

    again = select_backends(spec, "auto", cuda=False, measure=never, known=kept)
    assert [b.name for b in again.backends] == ["torch-cpu", "ort-cpu"]
    assert [b.name for b in again.step_backends] == ["torch-cpu", "ort-cpu"]  # 1 ms against 9
    assert {b.name: b.single_max_tokens for b in again.backends} == {"ort-cpu": 7, "torch-cpu": 9}
    reasons = {c.name: c.reason for c in again.candidates}
    assert "probe 5.000 ms" in reasons["torch-cpu"] and "step 1.000 ms" in reasons["torch-cpu"]
    assert again.timings == kept
    for backend in again.backends:  # every backend still self-checked and exact
        assert again.check.passes(backend)[0]
    other_model = Timings({name: ms[:-1] for name, ms in kept.probes.items()}, kept.steps, kept.one_thread)
    remeasured = select_backends(spec, "auto", cuda=False, measure=measure, known=other_model)
    assert remeasured.timings.probes == first.timings.probes  # not one time per probe shape: measured


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        '{"probes": {}, "steps": {}}',
        '{"probes": [], "steps": {}, "one_thread": {}}',
        '{"probes": {"ort-cpu": 1.0}, "steps": {}, "one_thread": {}}',
        '{"probes": {"ort-cpu": [1.0, -2.0]}, "steps": {}, "one_thread": {}}',
        '{"probes": {}, "steps": {"ort-cpu": "fast"}, "one_thread": {}}',
        '{"probes": {}, "steps": {}, "one_thread": {"ort-cpu": 1.5}}',
    ],
)
def test_timings_that_are_not_what_a_start_kept_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Timings.from_json(text)


def test_the_real_measurement_times_every_candidate(small_model_dir: Path) -> None:
    from service.backends.selection import measure_interleaved

    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    backends = [OrtCpuBackend(small_model_dir / "model.onnx", threads=1), TorchBackend(config, weights)]
    times = measure_interleaved(backends, config, rounds=3)
    shapes = probe_shapes(config)
    assert [len(t) for t in times] == [len(shapes)] * 2 and all(0 < ms < 10_000 for t in times for ms in t)
    assert shapes == sorted(shapes, key=lambda s: batch_mflop(*s, config.d_model))  # lightest first


def test_the_probe_reaches_four_of_the_models_longest_sequences() -> None:
    """The heaviest probe shape is four sequences of the model's longest T (up to 1024): there
    ORT-CPU hands its arena back after each run and PyTorch was three times faster
    (docs/benchmarks.md). Shorter models fold it into their longest shape."""
    assert probe_shapes(MHAConfig(d_model=128, n_head=8, max_seq_len=1024))[-2:] == [(4, 512), (4, 1024)]
    assert probe_shapes(MHAConfig(d_model=128, n_head=8, max_seq_len=512))[-1] == (4, 512)
    assert probe_shapes(MHAConfig(d_model=128, n_head=8, max_seq_len=768))[-1] == (4, 768)


@pytest.mark.parametrize(("one_round_s", "rounds"), [(0.0003, 41), (0.01, 21), (0.04, 5), (2.0, 3), (0.0, 41)])
def test_light_probe_shapes_get_more_rounds_within_the_budget(one_round_s: float, rounds: int) -> None:
    """A light shape's verdict rests on up to 41 runs of each backend (a noisy moment flipped the
    light shapes' order with 7), within about 0.2 s a shape; one too heavy for more on 3, the
    fewest whose median outvotes one stray run (a round of four 1024-token sequences took 0.18 s)."""
    assert probe_rounds(one_round_s, LEAST_ROUNDS, PROBE_BUDGET_S) == rounds


@pytest.mark.parametrize(
    ("times", "light"),
    [
        ([[1, 4, 20, 300], [2, 4.2, 10, 100]], (26.5, [0, 1], [1, 0])),  # ORT wins light shapes, torch heavy
        ([[1, 4, 20, 300], [2, 2.5, 10, 100]], (4.7, [0, 1], [1, 0])),  # torch 1.6x faster from (1, 64) on
        ([[1, 4, 20, 300], [2, 3.1, 10, 100]], (26.5, [0, 1], [1, 0])),  # 1.3x at (1, 64): not enough to move it
        ([[2, 5, 10, 100], [1, 4, 20, 300]], (4.7, [1, 0], [0, 1])),  # the other way round
        ([[1, 4, 10, 100], [2, 4.2, 20, 300]], None),  # one backend wins every shape: no split
        ([[1, 4, 10, 100], [2, 3.5, 9, 90]], None),  # never clearly faster: the preferred serves all
    ],
)
def test_light_and_heavy_batches_go_to_the_backend_that_wins_them(times: list, light: tuple | None) -> None:
    """The backend that wins the lightest shapes serves batches up to the boundary (midway, in
    ratio, between the last shape it wins and the next); the heavier go to the others' order."""
    works = [2.1, 10.5, 67.1, 805.3]  # (1, 16), (1, 64), (1, 256), (4, 512) at C = 128
    split = split_by_size(times, works)
    if light is None:
        assert split is None
        return
    assert split is not None
    boundary, light_order, heavy_order = light
    assert split.light_max_mflop == pytest.approx(boundary, rel=0.05)
    assert (split.light, split.heavy) == (light_order, heavy_order)


@pytest.mark.parametrize(
    ("times", "order"),
    [([10, 9], [0, 1]), ([10, 7.9], [1, 0]), ([10, 12], [0, 1]), ([10, 11, 5], [2, 0, 1]), ([10, 7.9, 8.5], [1, 0, 2])],
)
def test_the_preferred_backend_keeps_its_place_unless_clearly_slower(times: list[float], order: list[int]) -> None:
    assert speed_order(times) == order


def test_explicit_backend(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    selection = select_backends(BackendSpec(ModelFiles(small_model_dir).onnx, config, weights), "ort-cpu", cuda=False)
    assert [b.name for b in selection.backends] == ["ort-cpu"]
    selection = select_backends(BackendSpec(ModelFiles(small_model_dir).onnx, config, weights), "torch", cuda=False)
    assert [b.name for b in selection.backends] == ["torch-cpu"]


def test_ort_cuda_asked_for_without_cuda_is_unavailable_not_a_crash(small_model_dir: Path) -> None:
    """--backend ort-cuda where torch sees no CUDA once raised KeyError: 'ort-cuda'."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    selection = select_backends(BackendSpec(ModelFiles(small_model_dir).onnx, config, weights), "ort-cuda", cuda=False)
    assert selection.backends == []
    (candidate,) = selection.candidates
    assert (candidate.name, candidate.status) == ("ort-cuda", "unavailable")
    assert "needs a CUDA device" in candidate.reason


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_broken_onnx_falls_back_to_torch(small_model_dir: Path, tmp_path: Path, damage: str) -> None:
    for name in ("weights.safetensors", "manifest.json", "model.onnx"):
        shutil.copy(small_model_dir / name, tmp_path / name)
    if damage == "missing":
        (tmp_path / "model.onnx").unlink()
    else:
        (tmp_path / "model.onnx").write_bytes(b"not a protobuf" * 100)
    config, weights = load_checkpoint(tmp_path / "weights.safetensors")
    selection = select_backends(BackendSpec(ModelFiles(tmp_path).onnx, config, weights), "auto", cuda=False)
    assert [b.name for b in selection.backends] == ["torch-cpu"]
    ort_report = next(c for c in selection.candidates if c.name == "ort-cpu")
    assert ort_report.status == "unavailable" and "failed to load" in ort_report.reason


class Flaky(Backend):
    """A backend that fails while `broken` is set: stands in for a device error."""

    platform = "test"

    def __init__(self, name: str, inner: Backend) -> None:
        self.name, self.device, self.inner, self.broken, self.calls = name, "cpu", inner, False, 0

    def run(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.inner.run(x)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_chain_falls_back_benches_and_recovers(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    first = Flaky("ort-cpu", OrtCpuBackend(small_model_dir / "model.onnx", threads=1))
    second = TorchBackend(config, weights)
    fallbacks: list[tuple[str, str, str]] = []
    clock = Clock()
    check = SelfCheck(config, weights)
    chain = BackendChain(
        [first, second],
        probe=check.passes,
        failure_threshold=2,
        cooldown_s=10,
        on_fallback=lambda *a: fallbacks.append(a),
        clock=clock,
    )
    x = np.random.default_rng(1).standard_normal((2, 9, 32), dtype=np.float32)
    ref = attention_view(torch.from_numpy(x), weights, config)

    first.broken = True
    for _ in range(2):
        y, used = chain.run(x)
        assert used is second and relative_error(torch.from_numpy(y), ref) < 1e-5
    assert fallbacks == [("ort-cpu", "torch-cpu", "error")] * 2
    assert chain.quarantined() == ["ort-cpu"] and chain.active is second and chain.quarantine.any

    calls = first.calls
    chain.run(x)  # quarantined: not even tried
    assert first.calls == calls and len(fallbacks) == 2

    clock.now += 11  # cool-down over, still broken: the probe fails, quarantined again
    chain.run(x)
    assert first.calls == calls + 1 and chain.quarantined() == ["ort-cpu"] and chain.quarantine.any

    first.broken = False
    clock.now += 11  # cool-down over, repaired: the probe passes and it serves again
    y, used = chain.run(x)
    assert used is first and chain.quarantined() == [] and chain.active is first and not chain.quarantine.any
    assert relative_error(torch.from_numpy(y), ref) < 1e-5


def _publisher(metrics: Metrics) -> Publisher:
    """A publisher on `metrics`, its device any, always ready."""
    return Publisher(
        metrics, ServingBackends(metrics, DeviceHealth("any", metrics), lambda: True, lambda: None), Tracing()
    )


def test_backend_info_follows_a_backend_benched_at_run_time_and_back(small_model_dir: Path) -> None:
    """The serving backends are looked at again only when they may have changed (a backend's
    health changed, or one is quarantined): mha_backend_info still follows every change."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    first = Flaky("ort-cpu", OrtCpuBackend(small_model_dir / "model.onnx", threads=1))
    clock, metrics = Clock(), Metrics(CollectorRegistry())
    check = SelfCheck(config, weights)
    chain = BackendChain(
        [first, TorchBackend(config, weights)], check.passes, failure_threshold=2, cooldown_s=10, clock=clock
    )
    publisher = _publisher(metrics)
    publisher.serving.show(chain)
    x = np.random.default_rng(2).standard_normal((1, 4, 32), dtype=np.float32)

    def batch() -> dict[str, float | None]:
        _, used = chain.run(x)
        event = BatchEvent(
            requests=1, rows=1, seqs=(4,), padded_tokens=0, formation_s=0, compute_s=0, backend=used.name
        )
        publisher.batch(event, chain, "1")  # no event loop: what it leaves for after the answer runs at once
        get = metrics.registry.get_sample_value
        return {b: get("mha_backend_info", {"backend": b, "device": "cpu"}) for b in ("ort-cpu", "torch-cpu")}

    assert batch() == {"ort-cpu": 1, "torch-cpu": 0}
    first.broken = True
    assert batch() == {"ort-cpu": 1, "torch-cpu": 0}  # one failure: not quarantined yet
    assert batch() == {"ort-cpu": 0, "torch-cpu": 1}  # quarantined
    clock.now += 11  # the cool-down ends with the clock: ort-cpu is first in line again (to be probed)
    first.broken = False
    assert batch() == {"ort-cpu": 1, "torch-cpu": 0}  # probed, passed, serving
    assert batch() == {"ort-cpu": 1, "torch-cpu": 0}
    with publisher.statistics("1") as stats:
        assert stats.execution_count == 5


def test_light_batches_take_their_own_order_and_fall_back_along_it(small_model_dir: Path) -> None:
    """A small request goes to the backend that wins light shapes (ORT here), a
    heavy batch to the other's order; a failing light backend falls back to the next, exactly."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    ort = Flaky("ort-cpu", OrtCpuBackend(small_model_dir / "model.onnx", threads=1))
    torch_cpu = TorchBackend(config, weights)
    route = LightRoute(batch_mflop(1, 8, config.d_model), [ort, torch_cpu], config.d_model)
    chain = BackendChain([torch_cpu, ort], probe=SelfCheck(config, weights).passes, light=route)
    rng = np.random.default_rng(4)
    for shape, expected in (((1, 8, 32), ort), ((1, 9, 32), torch_cpu), ((3, 40, 32), torch_cpu)):
        x = rng.standard_normal(shape, dtype=np.float32)
        y, used = chain.run(x)
        assert used is expected, shape
        assert relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config)) < 1e-5
    assert chain.active is torch_cpu and chain.serving() == [torch_cpu, ort]  # both serve: mha_backend_info
    assert chain.describe() == "ort-cpu for batches of at most 0 MFLOP and torch-cpu above"  # the log: 0.07 MFLOP
    assert BackendChain([torch_cpu, ort], probe=SelfCheck(config, weights).passes).describe() == "torch-cpu"
    ort.broken = True
    x = rng.standard_normal((1, 4, 32), dtype=np.float32)
    y, used = chain.run(x)
    assert (
        used is torch_cpu
        and relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config)) < 1e-5
    )


def test_both_backends_of_a_split_show_as_serving(small_model_dir: Path) -> None:
    """mha_backend_info says 1 for each backend that serves some batches first, 0 for none."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    ort, torch_cpu = OrtCpuBackend(small_model_dir / "model.onnx", threads=1), TorchBackend(config, weights)
    check = SelfCheck(config, weights).passes
    metrics = Metrics(CollectorRegistry())
    publisher = _publisher(metrics)

    def info() -> dict[str, float | None]:
        get = metrics.registry.get_sample_value
        return {b: get("mha_backend_info", {"backend": b, "device": "cpu"}) for b in ("torch-cpu", "ort-cpu")}

    publisher.serving.show(BackendChain([torch_cpu, ort], probe=check))
    assert info() == {"torch-cpu": 1, "ort-cpu": 0}
    route = LightRoute(batch_mflop(1, 8, config.d_model), [ort, torch_cpu], config.d_model)
    publisher.serving.show(BackendChain([torch_cpu, ort], probe=check, light=route))
    assert info() == {"torch-cpu": 1, "ort-cpu": 1}


def test_auto_splits_by_size_where_the_measurement_crosses_over(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    shapes = probe_shapes(config)

    def measure(backends: list, config: MHAConfig) -> list[list[float]]:  # type: ignore[type-arg]
        ort = [1.0] + [100.0] * (len(shapes) - 1)  # ORT wins the lightest shape only
        return [ort if b.name == "ort-cpu" else [3.0] + [10.0] * (len(shapes) - 1) for b in backends]

    selection = select_backends(
        BackendSpec(ModelFiles(small_model_dir).onnx, config, weights), "auto", cuda=False, measure=measure
    )
    assert [b.name for b in selection.backends] == ["torch-cpu", "ort-cpu"]
    assert selection.light is not None and [b.name for b in selection.light.backends] == ["ort-cpu", "torch-cpu"]
    light = batch_mflop(*shapes[0], config.d_model)
    assert light < selection.light.max_mflop < batch_mflop(*shapes[1], config.d_model)
    reports = {c.name: c for c in selection.candidates}
    assert reports["ort-cpu"].status == reports["torch-cpu"].status == "serving"
    assert "batches of at most" in reports["ort-cpu"].reason and "batches over" in reports["torch-cpu"].reason


def test_chain_all_failing_is_backend_failure(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    a = Flaky("a", TorchBackend(config, weights))
    b = Flaky("b", TorchBackend(config, weights))
    a.broken = b.broken = True
    chain = BackendChain([a, b], probe=SelfCheck(config, weights).passes)
    with pytest.raises(BackendFailure, match="every backend failed"):
        chain.run(np.zeros((1, 2, 32), np.float32))


def test_a_chain_whose_every_backend_is_quarantined_is_unavailable_and_says_when(small_model_dir: Path) -> None:
    """Nothing computed, nothing failed: the server cannot serve now (UNAVAILABLE, which clients
    and balancers retry), not a fault of this request (INTERNAL)."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    a, b = (Flaky(name, TorchBackend(config, weights)) for name in "ab")
    a.broken = b.broken = True
    clock = ManualClock()
    chain = BackendChain([a, b], probe=lambda backend: (False, "still broken"), failure_threshold=1, clock=clock.now)
    with pytest.raises(BackendFailure, match="every backend failed"):  # both tried, both failed: quarantined
        chain.run(np.zeros((1, 2, 32), np.float32))
    clock.t += 12.0
    with pytest.raises(NotReady, match="checked again in 18 s") as info:
        chain.run(np.zeros((1, 2, 32), np.float32))
    assert to_status(info.value, "r")[0] == grpc.StatusCode.UNAVAILABLE


def test_a_backend_found_wrong_again_sits_out_twice_as_long_each_time(small_model_dir: Path) -> None:
    """Its probe is a fixed input, which a fault on some inputs passes: each audit that finds it
    wrong again doubles its cool-down (up to 2**7 of them); more mismatches while it sits out are
    answers it gave before, one incident, and change nothing."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    a, b = (Flaky(name, TorchBackend(config, weights)) for name in "ab")
    clock = ManualClock()
    chain = BackendChain([a, b], probe=lambda backend: (True, "passes"), cooldown_s=10, clock=clock.now)
    x = np.zeros((1, 2, 32), np.float32)
    sat_out = []
    for _ in range(10):
        chain.quarantine.enter("a")
        chain.quarantine.enter("a")  # an earlier answer of it, audited late: the same incident
        began = clock.t
        while chain.run(x)[1] is not a:  # b answers until a's cool-down is over and its probe passes
            clock.t += 5.0
        sat_out.append(clock.t - began)
    assert sat_out == [10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 1280.0, 1280.0]


def test_an_answer_found_wrong_while_a_backend_sits_out_for_errors_is_an_incident_of_its_own(
    small_model_dir: Path,
) -> None:
    """Out for raising errors, then found to have answered wrongly before: that counts, and it
    sits out the audit's cool-down from then, not only the rest of the errors'."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    a, b = (Flaky(name, TorchBackend(config, weights)) for name in "ab")
    clock = ManualClock()
    chain = BackendChain([a, b], lambda backend: (True, "passes"), failure_threshold=1, cooldown_s=10, clock=clock.now)
    x = np.zeros((1, 2, 32), np.float32)
    a.broken = True
    assert chain.run(x)[1] is b  # a raised: out for 10 s
    a.broken = False
    clock.t += 5.0
    chain.quarantine.enter("a")  # an answer it gave before, found wrong: out until 15
    clock.t += 6.0
    assert chain.run(x)[1] is b
    clock.t += 5.0
    assert chain.run(x)[1] is a
    chain.quarantine.enter("a")  # found wrong a second time: 20 s
    clock.t += 19.0
    assert chain.run(x)[1] is b


def test_another_workers_verdict_counts_here_and_sits_out_what_is_left_of_its_cool_down(
    small_model_dir: Path,
) -> None:
    """`join`: a verdict another worker reached (its count, how long ago) is this worker's own:
    the count carries on, the backend sits out only the rest of that incident's cool-down, and a
    verdict whose cool-down has passed (read by a worker started since) counts without
    quarantining. `enter` says the count, or 0 for the same incident."""
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    a, b = (Flaky(name, TorchBackend(config, weights)) for name in "ab")
    clock = ManualClock()
    chain = BackendChain([a, b], probe=lambda backend: (True, "passes"), cooldown_s=10, clock=clock.now)
    x, quarantine = np.zeros((1, 2, 32), np.float32), chain.quarantine

    def sits_out() -> float:
        began = clock.t
        while chain.run(x)[1] is not a:
            clock.t += 1.0
        return clock.t - began

    assert quarantine.join("a", times=3, ago_s=50.0) is False  # a 40 s cool-down, over 10 s ago
    assert chain.run(x)[1] is a  # not out, but the count carries on: found wrong a 4th time, 80 s
    assert quarantine.enter("a") == 4 and quarantine.enter("a") == 0  # then the same incident
    assert sits_out() == 80.0
    assert quarantine.join("a", times=6, ago_s=300.0) is True  # 320 s, 20 left
    assert sits_out() == 20.0
    assert quarantine.enter("a") == 7
    clock.t += 100.0
    assert quarantine.join("a", times=7, ago_s=100.0) is True  # this worker's own incident: nothing changes
    assert quarantine.join("a", times=5, ago_s=0.0) is True  # an older count: its own stays
    assert sits_out() == 540.0  # 640 s from its own finding
    assert quarantine.health["a"].found_wrong == 7


class NaNs(Backend):
    name, device, platform = "nan", "cpu", "test"

    def run(self, x: np.ndarray) -> np.ndarray:
        return np.full_like(x, np.nan)


def test_chain_treats_non_finite_output_as_a_fault(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    fallbacks: list[tuple[str, str, str]] = []
    chain = BackendChain(
        [NaNs(), TorchBackend(config, weights)],
        probe=SelfCheck(config, weights).passes,
        on_fallback=lambda *a: fallbacks.append(a),
    )
    y, used = chain.run(np.ones((1, 3, 32), np.float32))
    assert used.name == "torch-cpu" and np.isfinite(y).all()
    assert fallbacks == [("nan", "torch-cpu", "invalid_output")]


def test_self_check_rejects_wrong_weights(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    tampered = {**weights, "o_proj.bias": weights["o_proj.bias"] + 0.01}
    ok, why = SelfCheck(config, weights).passes(TorchBackend(config, tampered))
    assert not ok and "relative error" in why


def test_the_cuda_arena_is_capped_when_asked() -> None:
    from service.backends.ort import cuda_provider_options

    assert "gpu_mem_limit" not in cuda_provider_options(0, 0)
    capped = cuda_provider_options(1, 2048)
    assert capped["gpu_mem_limit"] == 2048 * 2**20 and capped["device_id"] == 1 and capped["use_tf32"] == 0


_V = "2026-11-30 12:06:37.6 [V:onnxruntime:, session_state.cc:1581 VerifyEachNodeIsAssignedToAnEp]"
GPU_LOG = "\n".join(  # what ORT's verbose log says when a graph is split between providers
    [
        f"{_V} Node placements",
        f"{_V}  Node(s) placed on [CUDAExecutionProvider]. Number of nodes: 3",
        *(f"{_V}   {op}" for op in ("MatMul (node_MatMul_3)", "Add (node_Add_4)", "MatMul (node_MatMul_11)")),
        f"{_V}  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 2",
        *(f"{_V}   {op}" for op in ("Shape (node_Shape_0)", "Attention (node_Attention_7)")),
        "2026-11-30 12:06:37.6 [V:onnxruntime:, session_state.cc:193 CreateGraphInfo] SaveMLValueNameIndexMapping",
    ]
)


def test_node_placements_are_read_from_onnx_runtime_itself(small_model_dir: Path) -> None:
    """get_providers() lists what is registered; the placement log says where nodes run."""
    from service.backends.ort import node_placements, off_device, parse_placements

    placements = parse_placements(GPU_LOG)
    assert placements == {
        "CUDAExecutionProvider": ["MatMul", "Add", "MatMul"],
        "CPUExecutionProvider": ["Shape", "Attention"],
    }
    assert off_device(placements, "CUDAExecutionProvider") == ["Attention"]  # Shape on the CPU is fine
    real = node_placements(small_model_dir / "model.onnx", ["CPUExecutionProvider"])  # a real session's log
    assert real == {"CPUExecutionProvider": ["*"]}
    assert off_device(real, "CUDAExecutionProvider") == ["every node"]
    assert off_device(real, "CPUExecutionProvider") == []
    assert off_device({}, "CUDAExecutionProvider")  # no log: not confirmed


class Overflows(Backend):
    """Answers non-finite rows for any input whose values reach 1e3 (as float32 attention would
    at ~1e20), and computes the others exactly: a lone backend, with no other one to ask."""

    name, device, platform = "overflows", "cpu", "test"

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def run(self, x: np.ndarray) -> np.ndarray:
        y = self.inner.run(x)
        y[np.abs(x).reshape(x.shape[0], -1).max(axis=1) >= 1e3] = np.inf
        return y


def test_overflowing_input_makes_a_lone_backend_check_itself_once_per_cool_down(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    check, probes, clock = SelfCheck(config, weights), [], Clock()

    def probe(backend: Backend) -> tuple[bool, str]:
        probes.append(backend.name)
        return check.passes(backend)

    chain = BackendChain([Overflows(TorchBackend(config, weights))], probe=probe, cooldown_s=10, clock=clock)
    x = np.full((1, 3, 32), 1e4, np.float32)
    for _ in range(20):  # a client sending overflowing requests as fast as it likes
        y, _ = chain.run(x)
        assert not np.isfinite(y).all()  # the input's doing: handed back (the core refuses it)
    assert len(probes) == 1, probes  # before: one full self-check per batch
    clock.now += 11
    chain.run(x)
    assert len(probes) == 2


class _Placed(Backend):
    """A backend that only says where it computes: the serving order's input (a CUDA device
    cannot be had here; bench/gpu_check.py's selection section measures the real ones)."""

    platform = "test"

    def __init__(self, name: str, device: str) -> None:
        self.name, self.device = name, device

    def run(self, x: np.ndarray) -> np.ndarray:
        return x


@pytest.mark.parametrize(("torch_ms", "serving"), [(4.0, "torch-cuda"), (9.0, "ort-cuda")])
def test_on_a_gpu_the_cuda_backends_race_and_the_cpu_ones_fall_back(
    small_model_dir: Path, torch_ms: float, serving: str
) -> None:
    from service.backends.selection import CandidateReport, _serving_order

    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    names = [("ort-cuda", "cuda:0"), ("torch-cuda", "cuda:0"), ("ort-cpu", "cpu"), ("torch-cpu", "cpu")]
    loaded = [(_Placed(n, d), CandidateReport(n, "unavailable", "self-check ok")) for n, d in names]
    raced: list[list[str]] = []

    def measure(race: list) -> list[list[float]]:  # type: ignore[type-arg]
        raced.append([b.name for b, _ in race])
        ms = {"ort-cuda": 10.0, "torch-cuda": torch_ms, "ort-cpu": 10.0, "torch-cpu": 20.0}
        return [[ms[b.name]] * len(probe_shapes(config)) for b, _ in race]

    ordered, light = _serving_order(loaded, True, measure, config)
    assert raced == [["ort-cuda", "torch-cuda"]], "the CPU backends are not raced on a GPU"
    order = [b.name for b, _ in ordered]
    assert order[0] == serving and order[2:] == ["ort-cpu", "torch-cpu"] and light is None
    assert [r.status for _, r in ordered] == ["serving", "fallback", "fallback", "fallback"]
    assert "probe" in ordered[0][1].reason
    cpu_only, _ = _serving_order(loaded[2:], True, measure, config)  # only CPU backends asked for, on a GPU
    assert raced[-1] == ["ort-cpu", "torch-cpu"] and [b.name for b, _ in cpu_only] == ["ort-cpu", "torch-cpu"]
