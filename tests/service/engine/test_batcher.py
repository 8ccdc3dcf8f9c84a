"""The batcher in three parts: planning (pure), merging (pure, exact), and waiting and running
(an injected clock and events, never sleep); then behind a real server."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint
from model.reference import attention_view, relative_error
from service.backends.pytorch import TorchBackend
from service.batching import (
    BatcherConfig,
    BatchEvent,
    batch_event,
    form_at,
    merge,
    plan_batch,
    split,
)
from service.client.client import InferenceError, MHAClient
from service.engine.door import Batcher
from service.errors import DeadlineExceeded, Overloaded
from tests.support import ComputeGate, ManualClock, ServerThread, make_settings

CONFIG = MHAConfig(d_model=16, n_head=2, max_seq_len=64)
WEIGHTS = init_weights(CONFIG, seed=9)
CFG = BatcherConfig(max_batch_size=8, max_queue_delay_s=0.05, max_padding_ratio=0.25)


@dataclass
class Req:
    rows: int
    seq: int
    enqueued: float = 0.0
    deadline: float | None = None
    gone: bool = False


# Planning: no event loop, no clock -------------------------------------------------------------


def test_mixed_t_share_a_batch_within_the_padding_bound() -> None:
    queue = [Req(1, 10), Req(2, 12), Req(1, 11), Req(3, 12)]
    plan = plan_batch(queue, CFG, now=0)
    assert plan.batch == queue and plan.rest == []  # 7 rows x 12 = 84 tokens, 3 padded: 3.6 %


def test_padding_is_bounded() -> None:
    queue = [Req(1, 64), Req(1, 2), Req(1, 60)]
    plan = plan_batch(queue, CFG, now=0)
    assert plan.batch == [queue[0], queue[2]] and plan.rest == [queue[1]]  # T=2 is not padded to 64


def test_non_causal_merges_only_equal_t() -> None:
    queue = [Req(1, 8), Req(1, 9), Req(2, 8)]
    plan = plan_batch(queue, BatcherConfig(max_batch_size=8, max_padding_ratio=0.5, causal=False), now=0)
    assert plan.batch == [queue[0], queue[2]] and plan.rest == [queue[1]]


def test_rows_never_exceed_max_batch_size_but_a_big_request_runs_alone() -> None:
    cfg = BatcherConfig(max_batch_size=6)
    queue = [Req(3, 4), Req(3, 4), Req(3, 4), Req(9, 4)]
    plan = plan_batch(queue, cfg, now=0)
    assert plan.batch == queue[:2] and plan.rest == queue[2:]
    assert plan_batch([Req(9, 4), Req(1, 4)], cfg, now=0).batch == [Req(9, 4)]


def test_a_merged_batch_stays_within_the_attention_budget() -> None:
    cfg = BatcherConfig(max_batch_size=8, max_cells=2 * 64 * 64)  # rows x T_max x T_max
    queue = [Req(1, 64), Req(1, 64), Req(1, 64), Req(1, 8)]
    plan = plan_batch(queue, cfg, now=0)
    assert plan.batch == queue[:2] and plan.rest == queue[2:]
    assert plan_batch([Req(1, 64), Req(2, 10)], cfg, now=0).batch == [Req(1, 64)]  # 3 rows padded to 64


def test_the_oldest_live_request_always_rides_and_order_is_kept() -> None:
    queue = [Req(1, 50, gone=True), Req(1, 3), Req(1, 60), Req(1, 4), Req(1, 5)]
    plan = plan_batch(queue, CFG, now=0)
    assert plan.batch == [queue[1], queue[3], queue[4]] and plan.rest == [queue[2]] and plan.gone == [queue[0]]


def test_dead_requests_are_set_apart() -> None:
    expired, alive, gone = Req(1, 4, deadline=5.0), Req(1, 4, deadline=5.1), Req(1, 4, gone=True)
    plan = plan_batch([expired, alive, gone], CFG, now=5.0)
    assert (plan.batch, plan.expired, plan.gone) == ([alive], [expired], [gone])
    assert plan_batch([expired, gone], CFG, now=5.0).batch == []


def _fits_by_definition(batch: list[Req], item: Req, cfg: BatcherConfig) -> bool:
    """The batch with `item` in it, recounted from scratch: the rules plan_batch keeps by sums."""
    joined = [*batch, item]
    rows, longest = sum(q.rows for q in joined), max(q.seq for q in joined)
    tokens = sum(q.rows * q.seq for q in joined)
    if rows > cfg.max_batch_size or (cfg.max_cells is not None and rows * longest**2 > cfg.max_cells):
        return False
    if not cfg.causal:
        return all(q.seq == item.seq for q in batch)
    return (rows * longest - tokens) / (rows * longest) <= cfg.max_padding_ratio


@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 80), st.booleans()), max_size=12),
    st.integers(1, 16),
    st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    st.booleans(),
    st.sampled_from([None, 4096, 40_000]),
)
def test_a_batch_is_the_oldest_live_request_and_every_later_one_that_fits_in_order(
    specs: list[tuple[int, int, bool]], size: int, padding: float, causal: bool, cells: int | None
) -> None:
    cfg = BatcherConfig(max_batch_size=size, max_padding_ratio=padding, causal=causal, max_cells=cells)
    queue = [Req(b, t, gone=gone) for b, t, gone in specs]
    plan = plan_batch(queue, cfg, now=0)
    live = [q for q in queue if not q.gone]
    batch: list[Req] = live[:1]
    for item in live[1:]:
        if _fits_by_definition(batch, item, cfg):
            batch.append(item)
    assert [id(q) for q in plan.batch] == [id(q) for q in batch]
    assert [id(q) for q in plan.rest] == [id(q) for q in live if all(q is not b for b in batch)]
    assert plan.gone == [q for q in queue if q.gone]


def test_when_to_form_a_batch() -> None:
    queue = [Req(1, 4, enqueued=10.0), Req(2, 4, enqueued=10.01)]
    assert form_at(queue, CFG, more_may_come=True) == pytest.approx(10.05)  # the oldest waits max_queue_delay
    assert form_at(queue, CFG, more_may_come=False) == -float("inf")  # a lone client pays no delay
    assert form_at([*queue, Req(5, 4)], CFG, more_may_come=True) == -float("inf")  # a full batch goes at once
    assert form_at(queue, BatcherConfig(max_batch_size=1), more_may_come=True) == -float("inf")  # batching off


# Merging: pure and exact -----------------------------------------------------------------------


def test_merge_then_split_is_exact_for_causal_attention() -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((b, t, 16), dtype=np.float32) for b, t in [(1, 10), (2, 12), (1, 3)]]
    merged = merge(xs)
    assert merged.shape == (4, 12, 16) and not merged[0, 10:].any() and not merged[3, 3:].any()
    ys = split(TorchBackend(CONFIG, WEIGHTS).run(merged), [(x.shape[0], x.shape[1]) for x in xs])
    for x, y in zip(xs, ys, strict=True):
        assert y.shape == x.shape
        assert relative_error(torch.from_numpy(y.copy()), attention_view(torch.from_numpy(x), WEIGHTS, CONFIG)) < 1e-5


# Waiting and running: an injected clock, a gated backend, events -------------------------------


class Gated:
    """The real model as the batch function; each batch waits for the test to open the gate."""

    def __init__(self, fail: bool = False, open_: bool = True, poison: float | None = None) -> None:
        self.backend = TorchBackend(CONFIG, WEIGHTS)
        self.batches: list[tuple[int, ...]] = []
        self.threads: list[bool] = []  # per batch: computed on the event loop's (main) thread
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.fail, self.poison = fail, poison
        if open_:
            self.gate.set()

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, TorchBackend]:
        self.batches.append(x.shape)
        self.threads.append(threading.current_thread() is threading.main_thread())
        self.entered.release()
        self.gate.wait(30)
        if self.fail or (self.poison is not None and bool((x == self.poison).any())):
            raise RuntimeError("device lost")
        return self.backend.run(x), self.backend


def _x(B: int, T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((B, T, 16), dtype=np.float32)


async def _until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until `predicate` holds (bounded: a stuck batcher fails the test)."""
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0)


async def _entered(run: Gated) -> None:
    assert await asyncio.to_thread(run.entered.acquire, True, 10), "the backend was never called"


Scenario = Callable[[Batcher, Gated, ManualClock], Coroutine[Any, Any, None]]


def _with_batcher(scenario: Scenario, config: BatcherConfig = CFG, run: Gated | None = None, in_flight: int = 99):
    events: list[BatchEvent] = []
    run = run or Gated()

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            clock = ManualClock()
            batcher = Batcher(config, run, pool, on_batch=events.append, in_flight=lambda: in_flight, clock=clock)
            batcher.start()
            await scenario(batcher, run, clock)
            run.gate.set()
            await batcher.stop()

    asyncio.run(main())
    return events, run


def test_a_lone_client_pays_no_delay() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        y, timing = await asyncio.wait_for(batcher.submit(_x(1, 4)), 10)  # the clock never moves
        assert y.shape == (1, 4, 16) and timing.queue_s == 0

    events, _ = _with_batcher(scenario, in_flight=1)
    assert [e.requests for e in events] == [1]


def test_a_lone_request_past_its_deadline_is_never_computed() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        with pytest.raises(DeadlineExceeded, match="deadline passed"):
            await batcher.submit(_x(1, 4), deadline=clock.now())
        assert (await batcher.submit(_x(1, 4), deadline=clock.now() + 1))[0].shape == (1, 4, 16)

    events, run = _with_batcher(scenario, CFG, in_flight=1)
    assert run.batches == [(1, 4, 16)] and run.threads == [False]  # on the worker thread
    assert [(e.requests, e.rows, e.seqs, e.formation_s) for e in events] == [(1, 1, (4,), 0.0)]


def test_with_others_in_the_server_the_first_request_waits_for_company_then_goes() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        first = asyncio.ensure_future(batcher.submit(_x(1, 4)))
        await _until(lambda: clock.waiting == 1)  # waiting for company, not computing
        second = asyncio.ensure_future(batcher.submit(_x(1, 6)))
        await _until(lambda: clock.waiting == 1 and batcher.depth == 2)
        assert run.batches == []
        clock.advance(CFG.max_queue_delay_s)
        await asyncio.gather(first, second)

    events, run = _with_batcher(scenario, in_flight=5)
    assert run.batches == [(2, 6, 16)]
    (event,) = events
    assert (event.requests, event.rows, event.seqs, event.padded_tokens) == (2, 2, (4, 6), 2)
    assert (event.formation_s, event.compute_s, event.backend) == (pytest.approx(0.05), 0.0, "torch-cpu")


def test_a_full_batch_does_not_wait() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        await asyncio.gather(*(batcher.submit(_x(2, 4, i)) for i in range(4)))  # 8 rows: full

    events, _ = _with_batcher(scenario, in_flight=50)
    assert [(e.requests, e.rows) for e in events] == [(4, 8)]


def test_expired_requests_are_never_computed() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        busy = asyncio.ensure_future(batcher.submit(_x(1, 5)))
        await _entered(run)  # the backend holds the first batch
        late = [asyncio.ensure_future(batcher.submit(_x(1, 7, i), deadline=clock.now() + 0.05)) for i in range(3)]
        ok = asyncio.ensure_future(batcher.submit(_x(1, 9), deadline=clock.now() + 5))
        await _until(lambda: batcher.depth == 4)
        clock.advance(0.1)
        run.gate.set()
        await busy
        for future in late:
            with pytest.raises(DeadlineExceeded, match=r"deadline passed after 100\.0 ms in the queue"):
                await future
        assert (await ok)[0].shape == (1, 9, 16)

    _, run = _with_batcher(scenario, BatcherConfig(max_batch_size=1), run=Gated(open_=False))
    assert run.batches == [(1, 5, 16), (1, 9, 16)]


def test_cancelled_requests_are_dropped_before_compute() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        busy = asyncio.ensure_future(batcher.submit(_x(1, 5)))
        await _entered(run)
        gone = asyncio.ensure_future(batcher.submit(_x(1, 6)))
        await _until(lambda: batcher.depth == 1)
        gone.cancel()
        run.gate.set()
        await busy

    _, run = _with_batcher(scenario, BatcherConfig(max_batch_size=1), run=Gated(open_=False))
    assert run.batches == [(1, 5, 16)]


def test_a_full_queue_is_overloaded_at_once() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        busy = asyncio.ensure_future(batcher.submit(_x(1, 3)))
        await _entered(run)
        queued = [asyncio.ensure_future(batcher.submit(_x(1, 3, i))) for i in range(2)]
        await _until(lambda: batcher.depth == 2)
        with pytest.raises(Overloaded, match=r"queue full: 2 requests waiting \(max_queue_size 2\)"):
            await batcher.submit(_x(1, 3, 9))  # raises before it would wait: the gate is still shut
        run.gate.set()
        await asyncio.gather(busy, *queued)

    _, run = _with_batcher(scenario, BatcherConfig(max_batch_size=1, max_queue_size=2), run=Gated(open_=False))
    assert len(run.batches) == 3


def test_a_failed_batch_is_rerun_member_by_member_so_only_the_culprit_fails() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        xs = [_x(1, 4, 0), np.full((1, 4, 16), 7.0, np.float32), _x(1, 4, 2)]
        results = await asyncio.gather(*(batcher.submit(x) for x in xs), return_exceptions=True)
        assert isinstance(results[1], RuntimeError)
        for x, result in zip(xs[::2], results[::2], strict=True):
            assert not isinstance(result, BaseException)
            y = torch.from_numpy(result[0].copy())
            assert relative_error(y, attention_view(torch.from_numpy(x), WEIGHTS, CONFIG)) < 1e-5

    events, run = _with_batcher(scenario, BatcherConfig(max_batch_size=3), run=Gated(poison=7.0), in_flight=3)
    assert run.batches == [(3, 4, 16), (1, 4, 16), (1, 4, 16), (1, 4, 16)]
    assert [(e.requests, e.error is not None) for e in events] == [(3, True), (1, False), (1, True), (1, False)]


def test_a_failing_backend_fails_each_request_once() -> None:
    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        results = await asyncio.gather(*(batcher.submit(_x(1, 4, i)) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)

    events, run = _with_batcher(scenario, BatcherConfig(max_batch_size=3), run=Gated(fail=True), in_flight=3)
    assert len(run.batches) == 4 and all(e.error is not None and e.backend == "" for e in events)


# Behind a real server ------------------------------------------------------------------------


def test_concurrent_clients_mixed_shapes_batch_and_stay_exact(small_model_dir: Path) -> None:
    settings = make_settings(  # every batch on the worker thread: this test is about batches forming
        small_model_dir,
        max_batch_size=16,
        max_queue_delay_ms=20,
        max_padding_ratio=0.75,
        backend="torch",
    )
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    shapes = [(1 + i % 3, [5, 8, 13, 16, 31, 32, 61, 64][i % 8]) for i in range(24)]
    errors: list[float] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(shapes))
    gate = ComputeGate(held=())
    with ServerThread(settings, compute_hook=gate) as server:
        batcher = server.engine.loaded.batcher
        gate.hold_next(lambda: batcher.depth >= 8)  # the first compute waits until others queue

        def one(i: int) -> None:
            B, T = shapes[i]
            x = np.random.default_rng(i).standard_normal((B, T, 32), dtype=np.float32)
            with MHAClient(server.url) as client:
                barrier.wait()
                try:
                    for _ in range(3):
                        y = client.infer(x, timeout=60)
                        errors.append(
                            relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config))
                        )
                except BaseException as exc:  # collected and asserted on below
                    failures.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(shapes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        with server.engine.publish.statistics("1") as held:
            stats = copy.deepcopy(held)
    assert not failures, failures[:3]
    assert len(errors) == 3 * len(shapes) and max(errors) < 1e-5
    assert stats.inference_count == 3 * sum(b for b, _ in shapes)
    assert 0 < stats.execution_count < 3 * len(shapes)  # requests shared batches
    assert sum(p.infer.count for p in stats.batches.values()) == stats.execution_count
    assert max(stats.batches) <= 16 and max(stats.batches) > 3  # more rows than any one request


def _requests_total(registry: CollectorRegistry, code: str) -> float:
    return registry.get_sample_value("mha_requests_total", {"method": "ModelInfer", "code": code}) or 0.0


def test_tiny_queue_under_load_answers_resource_exhausted_only(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, max_batch_size=1, max_queue_size=1, max_queue_delay_ms=0, backend="torch")
    codes: list[str] = []
    lock = threading.Lock()
    gate = ComputeGate(held=())
    with ServerThread(settings, compute_hook=gate) as server:
        # the first compute lasts until the full queue refused someone
        gate.hold_next(lambda: _requests_total(server.registry, "RESOURCE_EXHAUSTED") >= 1)

        def one(i: int) -> None:
            x = np.random.default_rng(i).standard_normal((4, 64, 32), dtype=np.float32)
            with MHAClient(server.url) as client:
                for _ in range(4):
                    try:
                        client.infer(x, timeout=60)
                        code = "OK"
                    except InferenceError as exc:
                        code = exc.code.name
                        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            assert "queue full" in str(exc)
                    with lock:
                        codes.append(code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        counted = {code: _requests_total(server.registry, code) for code in ("OK", "RESOURCE_EXHAUSTED")}
    assert len(codes) == 96
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
    assert counted == {"OK": codes.count("OK"), "RESOURCE_EXHAUSTED": codes.count("RESOURCE_EXHAUSTED")}


class SteppingClock(ManualClock):
    """Every reading moves time on by `step`: a request's deadline passes while it is queued."""

    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    def now(self) -> float:
        self.t += self.step
        return self.t


def test_the_servers_deadline_path_answers_deadline_exceeded(small_model_dir: Path) -> None:
    """The deadline expires in the server's queue (by the server's clock), not in the client."""
    settings = make_settings(small_model_dir, backend="torch")
    with ServerThread(settings, clock=SteppingClock(step=10.0)) as server, MHAClient(server.url) as client:
        with pytest.raises(InferenceError) as info:
            client.infer(np.ones((1, 4, 32), np.float32), timeout=15)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "in the queue" in str(info.value)  # the batcher's message: the server's path
        assert client.infer(np.ones((1, 4, 32), np.float32)).shape == (1, 4, 32)


def test_after_a_failed_batch_only_the_requests_still_awaited_run_again() -> None:
    """A request whose caller left while its batch computed is not computed again on its own."""

    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        xs = [_x(1, 4, 0), _x(1, 4, 1), np.full((1, 4, 16), 7.0, np.float32), _x(1, 4, 3)]
        tasks = [asyncio.ensure_future(batcher.submit(x)) for x in xs]
        await _entered(run)  # the batch of four computes
        tasks[1].cancel()
        await _until(lambda: tasks[1].done())
        run.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[1], asyncio.CancelledError) and isinstance(results[2], RuntimeError)

    gated = Gated(open_=False, poison=7.0)
    _, run = _with_batcher(scenario, BatcherConfig(max_batch_size=4), run=gated, in_flight=4)
    assert run.batches == [(4, 4, 16), (1, 4, 16), (1, 4, 16), (1, 4, 16)]  # the three still awaited


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 64)), min_size=1, max_size=5))
def test_a_batch_report_counts_rows_and_padding_for_one_request_as_for_many(shapes: list[tuple[int, int]]) -> None:
    """batch_event counts rows, padding and T in one pass; it must report what the definitions say."""
    event = batch_event(shapes, (1.0, 1.5), 2.0, "ort-cpu", None)
    rows, longest = sum(b for b, _ in shapes), max(t for _, t in shapes)
    assert (event.requests, event.rows, event.seqs) == (len(shapes), rows, tuple(t for _, t in shapes))
    assert event.padded_tokens == rows * longest - sum(b * t for b, t in shapes)
    assert (event.formation_s, event.compute_s, event.ended) == (0.5, 0.5, 2.0)
