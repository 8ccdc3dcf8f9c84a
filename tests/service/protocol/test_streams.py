"""Streams: answered concurrently, and nothing keeps computing or counts OK once the client is gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from service.protocol.grpc_streams import answer_concurrently
from tests.support import ComputeGate, ServerThread, make_settings, until

# answer_concurrently on its own -----------------------------------------------------------------


async def _numbers(n: int, fail_after: int | None = None) -> AsyncIterator[int]:
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise ValueError("corrupt message")
        yield i
        await asyncio.sleep(0)


def test_the_window_bounds_what_is_read_ahead_of_what_is_delivered() -> None:
    """With a window of 3, a consumer that takes one answer and stops coming back leaves the
    reader holding 3 requests read; each answer delivered lets one more in."""
    pulled: list[int] = []

    async def requests() -> AsyncIterator[int]:
        for i in range(20):
            pulled.append(i)
            yield i

    async def main() -> None:
        async def answer(i: int) -> int:
            return i

        stream = answer_concurrently(requests(), answer, window=3)
        async with asyncio.timeout(10):
            assert await anext(stream) == 0  # taken, not yet known delivered
            for _ in range(50):  # turns of the loop: the reader would read everything if it could
                await asyncio.sleep(0)
            assert len(pulled) == 3
            await anext(stream)  # the first delivered: one more may be read
            for _ in range(50):
                await asyncio.sleep(0)
            assert len(pulled) == 4
            await stream.aclose()

    asyncio.run(main())


def test_answers_every_request_as_it_completes() -> None:
    async def main() -> list[int]:
        async def answer(i: int) -> int:
            await asyncio.sleep(0.001 * (5 - i))  # later requests finish first
            return i * 10

        return [a async for a in answer_concurrently(_numbers(5), answer)]

    answers = asyncio.run(main())
    assert sorted(answers) == [0, 10, 20, 30, 40] and answers != sorted(answers)


def test_when_the_consumer_stops_every_unanswered_request_is_cancelled() -> None:
    started: set[int] = set()
    cancelled: set[int] = set()

    async def main() -> None:
        never = asyncio.Event()

        async def answer(i: int) -> int:
            started.add(i)
            if i == 0:
                return 0
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.add(i)
                raise
            return i

        stream = answer_concurrently(_numbers(6), answer)
        async with asyncio.timeout(10):  # a request left running would hang the close
            assert await anext(stream) == 0
            while len(started) < 6:
                await asyncio.sleep(0)
            await stream.aclose()  # what grpc does when the client cancels
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    asyncio.run(main())
    assert cancelled == {1, 2, 3, 4, 5}


def test_a_read_error_is_raised_after_what_was_read_is_answered() -> None:
    async def main() -> list[int]:
        got: list[int] = []
        with pytest.raises(ValueError, match="corrupt message"):
            async for a in answer_concurrently(_numbers(6, fail_after=3), lambda i: asyncio.sleep(0.001, i)):
                got.append(a)
        return got

    assert sorted(asyncio.run(main())) == [0, 1, 2]


# Behind a real server ---------------------------------------------------------------------------

N = 60
X = np.random.default_rng(0).standard_normal((1, 8, 128), dtype=np.float32)


def _gate(server: ServerThread) -> ComputeGate:
    """The server's compute hook, from now on holding each compute until the test gives a permit:
    the test, not the machine's speed, decides how much is computed before the client leaves."""
    gate = server.compute_hook
    assert isinstance(gate, ComputeGate)
    gate.held = ("batch",)
    return gate


@pytest.fixture
def server(default_model_dir: Path) -> Iterator[ServerThread]:
    settings = make_settings(default_model_dir, backend="torch", max_batch_size=1, max_queue_delay_ms=0)
    with ServerThread(settings, compute_hook=ComputeGate(held=())) as s:
        yield s


def _requests() -> Iterator[object]:
    for i in range(N):
        yield encode_infer_request(X, request_id=str(i))


def _steady(count: Callable[[], int], timeout_s: float = 60.0) -> int:
    """`count()` once it has not changed for half a second (the server has stopped reading)."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if (now := count()) != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return last
    raise AssertionError(f"the count never settled (last {last})")


def _settle(server: ServerThread) -> None:
    deadline = time.monotonic() + 60
    while server.engine.requests.count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.requests.count == 0


def _stream_counts(server: ServerThread) -> dict[str, float]:
    get = server.registry.get_sample_value
    codes = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")
    return {c: get("mha_requests_total", {"method": "ModelStreamInfer", "code": c}) or 0.0 for c in codes}


def test_a_cancelled_stream_stops_computing_and_is_counted_cancelled(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    gate = _gate(server)
    with grpc.insecure_channel(server.url) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(_requests(), timeout=120)
        gate.permits.release()  # one compute, one answer
        first = next(call)
        assert not first.error_message
        until(lambda: server.engine.requests.count >= 2)  # more read: the client's sender may lag under load
        call.cancel()
    deadline = time.monotonic() + 30  # the server hears of the cancel (its queued requests are dropped) ...
    while not _stream_counts(server)["CANCELLED"] and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.permits.release(N)  # ... then anything may compute: only what the server still wants does
    _settle(server)
    counts = _stream_counts(server)
    assert len(gate.computed) <= 2, (
        f"{len(gate.computed)} of {N} requests computed (the answered one, the one computing)"
    )
    assert counts["CANCELLED"] >= 1 and counts["OK"] <= len(gate.computed), counts
    assert counts["INTERNAL"] == counts["UNKNOWN"] == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors  # a client that leaves is no server fault: no ERROR, no traceback


def test_an_expired_stream_stops_computing_and_is_counted_deadline_exceeded(server: ServerThread) -> None:
    gate = _gate(server)
    with grpc.insecure_channel(server.url) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(_requests(), timeout=0.3)
        with pytest.raises(grpc.RpcError) as info:
            list(call)  # nothing computes until the deadline has passed
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.permits.release(N)
    _settle(server)
    counts = _stream_counts(server)
    assert len(gate.computed) <= 1, f"{len(gate.computed)} of {N} requests computed after the deadline"
    assert counts["DEADLINE_EXCEEDED"] >= 1 and counts["CANCELLED"] == 0, counts
    assert counts["OK"] <= len(gate.computed)  # the one held at the gate may finish before the stream ends


def test_a_stream_closed_under_its_generator_is_cancelled_not_a_fault(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """gRPC closes a stream's generator from another task when the client leaves while it waits
    at a `yield` (GeneratorExit, in another context): that is the client's departure."""
    from service.protocol.calls import Calls

    engine = server.engine
    calls = Calls(engine.door, engine.metrics, engine.tracing)

    async def scenario() -> None:
        async def stream():  # type: ignore[no-untyped-def]
            async with calls.stream("ModelStreamInfer", None):
                yield 1

        generator = stream()
        await generator.__anext__()
        await asyncio.get_running_loop().create_task(generator.aclose())

    asyncio.run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors


def test_an_answer_counts_delivered_only_once_the_consumer_came_back_for_the_next() -> None:
    settled: list[tuple[int, bool]] = []

    async def main() -> None:
        computed: list[int] = []

        async def answer(i: int) -> int:
            computed.append(i)
            return i

        stream = answer_concurrently(_numbers(5), answer, settle=lambda a, d: settled.append((a, d)))
        first = await anext(stream)
        second = await anext(stream)  # the consumer came back: `first` was written
        while len(computed) < 5:
            await asyncio.sleep(0)
        await stream.aclose()  # closed at the yield of `second`: its write never completed
        assert settled[0] == (first, True)
        assert (second, False) in settled

    asyncio.run(main())
    answers = [a for a, _ in settled]
    assert sorted(answers) == [0, 1, 2, 3, 4], settled  # every computed answer settled, once
    assert [a for a, delivered in settled if delivered] == [answers[0]]


@contextlib.contextmanager
def _read_one_then_stop(server: ServerThread, x: np.ndarray, timeout_s: float) -> Iterator[tuple[Any, int]]:
    """A stream of N requests of `x` whose client reads one answer and stops reading: the call,
    and how many requests the server computed by the time it stopped too."""
    gate = _gate(server)
    gate.permits.release(N)
    with grpc.insecure_channel(server.url) as channel:
        requests = (encode_infer_request(x, request_id=str(i)) for i in range(N))
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests, timeout=timeout_s)
        assert not next(call).error_message
        yield call, _steady(lambda: len(gate.computed))


def test_a_stream_that_never_reads_is_held_at_its_window_and_what_was_never_written_is_cancelled(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reads one answer and stops reading: the server reads no more than
    --stream-window requests beyond what gRPC has written (flow control holds the rest in the
    client), computes only those, and when the client leaves, what was never written is
    CANCELLED; OK counts only what was written."""
    x = np.random.default_rng(1).standard_normal((1, 1024, 128), dtype=np.float32)  # 512 KiB answers
    window = server.engine.settings.stream_window
    with _read_one_then_stop(server, x, timeout_s=120) as (call, computed):
        call.cancel()
    # beyond the window: the answers gRPC accepted for writing (its flow control buffers a few MiB)
    assert window <= computed <= window + 16 < N, f"{computed} computed for a client that read 1 (window {window})"
    _settle(server)
    counts = _stream_counts(server)
    assert counts["OK"] + counts["CANCELLED"] == computed, counts
    assert counts["OK"] < window, counts
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors  # gRPC's failed write under a departed client is no server fault


def _all_stream_counts(server: ServerThread) -> dict[str, float]:
    """Every code ModelStreamInfer's requests were counted with, as /metrics reads."""
    counts: dict[str, float] = {}
    for family in server.registry.collect():
        for sample in family.samples:
            if sample.name == "mha_requests_total" and sample.labels.get("method") == "ModelStreamInfer":
                counts[sample.labels["code"]] = counts.get(sample.labels["code"], 0.0) + sample.value
    return {code: value for code, value in counts.items() if value}


def test_a_stream_cut_by_its_deadline_counts_what_the_client_received(server: ServerThread) -> None:
    """The issue's case: a stream with a deadline and many queued requests, read by a plain
    reader. The client's tally (answers received, and the stream's end) and /metrics agree:
    each answer it received counted OK, nothing else OK, the rest DEADLINE_EXCEEDED, and no
    request counted with a code it was not answered with."""
    gate = _gate(server)
    received: list[str] = []
    ended: list[grpc.StatusCode] = []
    got_five = threading.Event()

    def read(call: Iterator[object]) -> None:
        try:
            for answer in call:
                assert not answer.error_message, answer.error_message  # type: ignore[attr-defined]
                received.append(answer.infer_response.id)  # type: ignore[attr-defined]
                if len(received) == 5:
                    got_five.set()
        except grpc.RpcError as exc:
            ended.append(exc.code())

    with grpc.insecure_channel(server.url) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(_requests(), timeout=2.0)
        reader = threading.Thread(target=read, args=(call,))
        reader.start()
        gate.permits.release(5)  # five answers computed, then nothing until the deadline has passed
        assert got_five.wait(30), f"the client received {len(received)} of 5 answers"
        reader.join(60)
    assert ended == [grpc.StatusCode.DEADLINE_EXCEEDED]
    # the client's timer runs ahead of the server's by the call's transit (on a loaded machine, tens
    # of ms): an answer the server wrote before its own deadline, after the client's, is one gRPC
    # took and the client never read. The gate opens once the server too has ended the call.
    until(lambda: "DEADLINE_EXCEEDED" in _all_stream_counts(server), what="the server's deadline passed")
    gate.permits.release(N)
    _settle(server)
    counts = _all_stream_counts(server)
    assert counts.get("OK") == len(received) == 5, (counts, received)
    assert set(counts) == {"OK", "DEADLINE_EXCEEDED"}, counts


def test_a_slow_reader_cut_by_its_deadline_is_counted_ok_only_for_what_grpc_took(server: ServerThread) -> None:
    """A client that reads one answer and stops until its deadline: the server computes up to
    --stream-window requests, writes what gRPC's flow control lets it (into the client's
    library, which drops it when the deadline fires) and counts the rest DEADLINE_EXCEEDED.
    OK never counts what was computed and not written; docs/operations.md says what it counts."""
    x = np.random.default_rng(1).standard_normal((2, 512, 128), dtype=np.float32)  # 512 KiB answers
    window = server.engine.settings.stream_window
    with _read_one_then_stop(server, x, timeout_s=3.0) as (call, computed):
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        assert done.wait(60), "the deadline never ended the call"  # not read until then
        with pytest.raises(grpc.RpcError) as info:
            list(call)  # what the library held is dropped with the call
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _settle(server)
    counts = _all_stream_counts(server)
    assert window <= computed < N, computed
    assert set(counts) <= {"OK", "DEADLINE_EXCEEDED"}, counts
    assert counts.get("OK", 0) + counts.get("DEADLINE_EXCEEDED", 0) >= computed, counts
    assert 1 <= counts.get("OK", 0) < computed, counts
