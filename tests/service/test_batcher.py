"""The batcher on its own (asyncio, a real model as the batch function) and behind a real server."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint
from model.reference import attention_view, relative_error
from service.backends.pytorch import TorchBackend
from service.batcher import Batcher, BatcherConfig
from service.client import InferenceError, MHAClient
from service.errors import DeadlineExceeded, Overloaded
from tests.support import ServerThread, make_settings

CONFIG = MHAConfig(d_model=16, n_head=2, max_seq_len=64)
WEIGHTS = init_weights(CONFIG, seed=9)


class Recorder:
    """The real model as the batch function, recording every batch it computed."""

    def __init__(self, config: MHAConfig = CONFIG, delay_s: float = 0.0, fail: bool = False) -> None:
        self.backend = TorchBackend(config, WEIGHTS)
        self.batches: list[tuple[int, int, int]] = []
        self.delay_s, self.fail = delay_s, fail

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, str]:
        self.batches.append(x.shape)
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("device lost")
        return self.backend.run(x), "torch-cpu"


def _x(B: int, T: int, seed: int, C: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((B, T, C), dtype=np.float32)


async def _run(config: BatcherConfig, recorder: Recorder, inputs: list[np.ndarray], deadlines=None):
    with ThreadPoolExecutor(1) as pool:
        batcher = Batcher(config, recorder, pool)
        batcher.start()
        deadlines = deadlines or [None] * len(inputs)
        results = await asyncio.gather(
            *(batcher.submit(x, d) for x, d in zip(inputs, deadlines, strict=True)), return_exceptions=True
        )
        await batcher.stop()
        return batcher, results


def test_mixed_t_share_a_batch_exactly() -> None:
    inputs = [_x(1, 10, 0), _x(2, 12, 1), _x(1, 11, 2), _x(3, 12, 3)]
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_s=0.05, max_padding_ratio=0.25)
    batcher, results = asyncio.run(_run(cfg, Recorder(), inputs))
    assert batcher.counters.batches == 1 and batcher.counters.mixed_t_batches == 1
    assert batcher.counters.padded_tokens == 1 * 2 + 1 * 1
    for x, (y, timing) in zip(inputs, results, strict=True):
        assert y.shape == x.shape and timing.batch_rows == 7
        ref = attention_view(torch.from_numpy(x), WEIGHTS, CONFIG)
        assert relative_error(torch.from_numpy(np.array(y)), ref) < 1e-5


def test_padding_is_bounded() -> None:
    inputs = [_x(1, 64, 0), _x(1, 2, 1), _x(1, 60, 2)]
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_s=0.05, max_padding_ratio=0.25)
    recorder = Recorder()
    _, results = asyncio.run(_run(cfg, recorder, inputs))
    assert sorted(recorder.batches) == [(1, 2, 16), (2, 64, 16)]  # T=2 is not padded to 64
    assert all(not isinstance(r, BaseException) for r in results)


def test_non_causal_merges_only_equal_t() -> None:
    config = MHAConfig(d_model=16, n_head=2, max_seq_len=64, causal=False)
    inputs = [_x(1, 8, 0), _x(1, 9, 1), _x(2, 8, 2)]
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_s=0.05, max_padding_ratio=0.5, causal=False)
    recorder = Recorder(config)
    _, results = asyncio.run(_run(cfg, recorder, inputs))
    assert sorted(recorder.batches) == [(1, 9, 16), (3, 8, 16)]
    for x, (y, _) in zip(inputs, results, strict=True):
        ref = attention_view(torch.from_numpy(x), WEIGHTS, config)
        assert relative_error(torch.from_numpy(np.array(y)), ref) < 1e-5


def test_batching_off_with_max_batch_size_one() -> None:
    inputs = [_x(1, 4, i) for i in range(5)]
    recorder = Recorder()
    batcher, _ = asyncio.run(_run(BatcherConfig(max_batch_size=1, max_queue_delay_s=0.05), recorder, inputs))
    assert recorder.batches == [(1, 4, 16)] * 5 and batcher.counters.merged_batches == 0


def test_rows_never_exceed_max_batch_size_but_big_requests_run_alone() -> None:
    inputs = [_x(3, 4, 0), _x(3, 4, 1), _x(3, 4, 2), _x(9, 4, 3)]
    recorder = Recorder()
    asyncio.run(_run(BatcherConfig(max_batch_size=6, max_queue_delay_s=0.05), recorder, inputs))
    assert sorted(recorder.batches) == [(3, 4, 16), (6, 4, 16), (9, 4, 16)]


def test_failed_batch_fails_every_waiter_alike() -> None:
    inputs = [_x(1, 4, i) for i in range(3)]
    _, results = asyncio.run(_run(BatcherConfig(max_batch_size=8, max_queue_delay_s=0.05), Recorder(fail=True), inputs))
    assert all(isinstance(r, RuntimeError) for r in results)
    assert len({id(r) for r in results}) == 1  # the very same error


def test_expired_requests_are_never_computed() -> None:
    async def scenario() -> tuple[Recorder, Batcher, list[object]]:
        recorder = Recorder(delay_s=0.2)
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher(BatcherConfig(max_batch_size=1, max_queue_delay_s=0), recorder, pool)
            batcher.start()
            slow = asyncio.ensure_future(batcher.submit(_x(1, 5, 0)))  # occupies the backend for 0.2 s
            await asyncio.sleep(0.02)
            soon = time.monotonic() + 0.05
            late = [asyncio.ensure_future(batcher.submit(_x(1, 7, i), deadline=soon)) for i in range(3)]
            ok = asyncio.ensure_future(batcher.submit(_x(1, 9, 9), deadline=time.monotonic() + 5))
            results = await asyncio.gather(slow, *late, ok, return_exceptions=True)
            await batcher.stop()
            return recorder, batcher, results

    recorder, batcher, results = asyncio.run(scenario())
    assert all(isinstance(r, DeadlineExceeded) for r in results[1:4])
    assert not isinstance(results[4], BaseException)
    assert (1, 7, 16) not in recorder.batches and recorder.batches == [(1, 5, 16), (1, 9, 16)]
    assert batcher.counters.expired == 3


def test_cancelled_requests_are_dropped() -> None:
    async def scenario() -> tuple[Recorder, Batcher]:
        recorder = Recorder(delay_s=0.1)
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher(BatcherConfig(max_batch_size=1, max_queue_delay_s=0), recorder, pool)
            batcher.start()
            first = asyncio.ensure_future(batcher.submit(_x(1, 5, 0)))
            await asyncio.sleep(0.02)
            gone = asyncio.ensure_future(batcher.submit(_x(1, 6, 1)))
            await asyncio.sleep(0.01)
            gone.cancel()
            await first
            await batcher.stop()
            return recorder, batcher

    recorder, batcher = asyncio.run(scenario())
    assert recorder.batches == [(1, 5, 16)] and batcher.counters.cancelled == 1


def test_full_queue_is_overloaded_at_once() -> None:
    async def scenario() -> list[object]:
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher(
                BatcherConfig(max_batch_size=1, max_queue_delay_s=0, max_queue_size=2), Recorder(delay_s=0.1), pool
            )
            batcher.start()
            first = asyncio.ensure_future(batcher.submit(_x(1, 3, 0)))
            await asyncio.sleep(0.02)  # first is computing; the queue is empty again
            queued = [asyncio.ensure_future(batcher.submit(_x(1, 3, i))) for i in range(2)]
            await asyncio.sleep(0)
            started = time.monotonic()
            with pytest.raises(Overloaded, match=r"queue full: 2 requests waiting \(max_queue_size 2\)"):
                await batcher.submit(_x(1, 3, 9))
            assert time.monotonic() - started < 0.05  # at once, not after waiting
            results = await asyncio.gather(first, *queued)
            await batcher.stop()
            return list(results)

    assert len(asyncio.run(scenario())) == 3


# Behind a real server ------------------------------------------------------------------------


def test_concurrent_clients_mixed_shapes_batch_and_stay_exact(small_model_dir: Path) -> None:
    settings = make_settings(
        small_model_dir, max_batch_size=16, max_queue_delay_ms=20, max_padding_ratio=0.75, backend="torch"
    )
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    shapes = [(1 + i % 3, [5, 8, 13, 16, 31, 32, 61, 64][i % 8]) for i in range(24)]
    errors: list[float] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(shapes))
    with ServerThread(settings) as server:

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
        counters = server.core.batcher.counters
    assert not failures, failures[:3]
    assert len(errors) == 3 * len(shapes) and max(errors) < 1e-5
    assert counters.requests == 3 * len(shapes)
    assert counters.merged_batches > 0 and counters.mixed_t_batches > 0
    assert counters.batches < counters.requests
    assert counters.largest_batch_rows <= 16


def test_tiny_queue_under_load_answers_resource_exhausted_only(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, max_batch_size=1, max_queue_size=1, max_queue_delay_ms=0, backend="torch")
    codes: list[str] = []
    lock = threading.Lock()
    with ServerThread(settings) as server:

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
        rejected = server.core.batcher.counters.rejected_full
    assert len(codes) == 96
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
    assert rejected == codes.count("RESOURCE_EXHAUSTED")


def test_deadline_exceeded_through_the_server(small_model_dir: Path) -> None:
    settings = make_settings(small_model_dir, max_batch_size=1, max_queue_delay_ms=0, backend="torch")
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        with pytest.raises(InferenceError) as info:
            client.infer(np.ones((1, 4, 32), np.float32), timeout=0.000001)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.infer(np.ones((1, 4, 32), np.float32)).shape == (1, 4, 32)
