"""Triton's schedule policy on the stateless queue: priority levels, per-level queue policies
(REJECT and DELAY timeouts, max_queue_size, timeout override) and the starvation bound. Pure
rules first, then the engine on an injected clock with its compute held by the test."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.batching import BatcherConfig
from service.engine.door import Batcher
from service.errors import DeadlineExceeded, InvalidInput, Overloaded
from service.scheduling import QueuePolicy, SchedulePolicy, WaitQueue, parse_queue_policies
from tests.service.engine.test_batcher import Gated, _entered, _until, _x
from tests.support import ManualClock

ONE_AT_A_TIME = BatcherConfig(max_batch_size=1, max_queue_delay_s=0.0)


# The rules, pure ---------------------------------------------------------------------------------


def test_a_request_may_shorten_its_levels_timeout_only_where_the_policy_allows() -> None:
    assert QueuePolicy(default_timeout_microseconds=5000).timeout_s(0.001) == 0.001  # shorter: it stands
    assert QueuePolicy(default_timeout_microseconds=5000).timeout_s(9.0) == 0.005  # longer: Triton's rule
    assert QueuePolicy().timeout_s(2.0) == 2.0  # the level has none: the request's
    assert QueuePolicy().timeout_s(None) is None
    fixed = QueuePolicy(default_timeout_microseconds=5000, allow_timeout_override=False)
    assert fixed.timeout_s(0.001) == 0.005


def test_priority_zero_is_the_default_level_and_a_level_outside_is_refused() -> None:
    schedule = SchedulePolicy(priority_levels=3, default_priority_level=2)
    assert [schedule.level(p) for p in (0, 1, 2, 3)] == [2, 1, 2, 3]
    with pytest.raises(InvalidInput, match=r"priority 4: this model has priority levels 1\.\.3"):
        schedule.level(4)
    with pytest.raises(ValueError, match=r"outside the levels 1\.\.2"):
        SchedulePolicy(priority_levels=2, default_priority_level=3)
    with pytest.raises(ValueError, match="queue policy for level 5"):
        SchedulePolicy(priority_levels=2, priority_queue_policy={5: QueuePolicy()})


def test_the_flag_reads_triton_field_names() -> None:
    default, levels = parse_queue_policies(
        "timeout_action=DELAY,default_timeout_microseconds=5000; 2:max_queue_size=16,allow_timeout_override=false"
    )
    assert default == QueuePolicy(timeout_action="DELAY", default_timeout_microseconds=5000)
    assert levels == {2: QueuePolicy(max_queue_size=16, allow_timeout_override=False)}
    for wrong, says in [
        ("timeout_action=LATER", "REJECT or DELAY"),
        ("max_queue_size=-1", "expected a count"),
        ("x:max_queue_size=1", "LEVEL a number"),
        ("max_queue_size=²", "expected a count"),  # '²' passes isdigit() and fails int()
        ("²:max_queue_size=1", "LEVEL a number"),
        ("timeout=5", "is not one of timeout_action"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_queue_policies(wrong)


@given(st.text(max_size=120))
def test_any_flag_text_is_read_or_refused_with_a_value_error(text: str) -> None:
    with contextlib.suppress(ValueError):
        parse_queue_policies(text)


@dataclass(eq=False)
class Waiting:
    name: str
    level: int = 1
    arrival: int = 0
    timeout_at: float | None = None
    delays: bool = False
    delayed: bool = False
    overtaken: int = 0
    gone: bool = False


def _names(items: list[Waiting]) -> list[str]:
    return [item.name for item in items]


def test_a_lower_level_waits_for_at_most_max_overtakes_batches() -> None:
    """Strict priority (0) starves the low request; a bound of 2 lets it go first after two batches."""
    for bound, served_low_after in [(0, None), (2, 2)]:
        queue = WaitQueue[Waiting](SchedulePolicy(priority_levels=2, max_overtakes=bound), max_queue_size=99)
        queue.admit(Waiting("low"), priority=2, timeout_s=None, now=0)
        for n in range(4):  # a stream of high-priority requests, one batch each
            queue.admit(Waiting(f"high{n}"), priority=1, timeout_s=None, now=0)
            first, *rest = queue.in_order()
            queue.leave([first], rest)
            if first.name == "low":
                assert n == served_low_after
                break
        else:
            assert served_low_after is None and _names(queue.items) == ["low"]


def test_delay_puts_a_timed_out_request_behind_its_level_but_ahead_of_lower_ones() -> None:
    delay = QueuePolicy(timeout_action="DELAY", default_timeout_microseconds=1000)
    queue = WaitQueue[Waiting](SchedulePolicy(priority_levels=2, default_queue_policy=delay), max_queue_size=99)
    for name, level, now in [("a", 1, 0.0), ("b", 1, 0.0005), ("low", 2, 0.0)]:
        queue.admit(Waiting(name), level, None, now)
    assert _names(queue.in_order()) == ["a", "b", "low"]
    assert queue.time_out(0.0012) == [] and _names(queue.in_order()) == ["b", "a", "low"]  # a's time passed
    assert queue.next_timeout == pytest.approx(0.0015)


# The engine, on an injected clock ---------------------------------------------------------------------


def _run(scenario, schedule: SchedulePolicy, config: BatcherConfig = ONE_AT_A_TIME) -> Gated:  # type: ignore[no-untyped-def]
    run = Gated(open_=False)  # each batch waits for the test

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            clock = ManualClock()
            batcher = Batcher(config, run, pool, in_flight=lambda: 99, clock=clock, schedule=schedule)
            batcher.start()
            await scenario(batcher, run, clock)
            run.gate.set()
            await batcher.stop()

    asyncio.run(main())
    return run


def test_a_reject_timeout_fires_on_time_while_a_batch_computes() -> None:
    """Triton's timeouts fire only when the next batch forms (server#5783): ours at their time."""
    reject = QueuePolicy(default_timeout_microseconds=10_000)

    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        busy = asyncio.ensure_future(batcher.submit(_x(1, 3)))
        await _entered(run)  # computing, held by the test
        waiting = asyncio.ensure_future(batcher.submit(_x(1, 5)))
        await _until(lambda: batcher.depth == 1 and clock.waiting == 1)
        clock.advance(0.009)
        await asyncio.sleep(0)
        assert not waiting.done()
        clock.advance(0.002)  # 11 ms: past its 10 ms, the batch ahead still computing
        with pytest.raises(DeadlineExceeded, match=r"queue timeout passed after 11\.0 ms in the queue"):
            await asyncio.wait_for(waiting, 10)
        assert not busy.done() and batcher.depth == 0
        run.gate.set()
        await busy

    run = _run(scenario, SchedulePolicy(default_queue_policy=reject))
    assert run.batches == [(1, 3, 16)]  # the timed-out request was never computed


def test_higher_priority_overtakes_and_delay_goes_behind_its_level() -> None:
    policies = {2: QueuePolicy(timeout_action="DELAY", default_timeout_microseconds=1000)}
    schedule = SchedulePolicy(priority_levels=3, default_priority_level=2, priority_queue_policy=policies)

    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        calls = [asyncio.ensure_future(batcher.submit(_x(1, 2)))]  # computing, held
        await _entered(run)
        for t, priority in [(3, 3), (4, 2), (5, 0), (6, 1)]:  # T names each; 0: the default level, 2
            calls.append(asyncio.ensure_future(batcher.submit(_x(1, t), priority=priority)))
            await _until(lambda t=t: batcher.depth == t - 2)  # type: ignore[misc]
            if t == 4:  # its DELAY timeout passes: it goes behind T=5, which comes in time
                await _until(lambda: clock.waiting == 1)
                clock.advance(0.002)
                await _until(lambda: clock.waiting == 0)
        run.gate.set()
        await asyncio.gather(*calls)

    run = _run(scenario, schedule)
    assert [shape[1] for shape in run.batches] == [2, 6, 5, 4, 3]


def test_a_full_level_refuses_while_other_levels_still_queue() -> None:
    schedule = SchedulePolicy(priority_levels=2, priority_queue_policy={2: QueuePolicy(max_queue_size=1)})

    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        calls = [asyncio.ensure_future(batcher.submit(_x(1, 2)))]
        await _entered(run)
        calls.append(asyncio.ensure_future(batcher.submit(_x(1, 3), priority=2)))
        await _until(lambda: batcher.depth == 1)
        with pytest.raises(Overloaded, match="queue full at priority level 2: 1 requests waiting"):
            await batcher.submit(_x(1, 4), priority=2)
        calls.append(asyncio.ensure_future(batcher.submit(_x(1, 5), priority=1)))
        await _until(lambda: batcher.depth == 2)
        with pytest.raises(InvalidInput, match="priority 3"):
            await batcher.submit(_x(1, 4), priority=3)
        run.gate.set()
        await asyncio.gather(*calls)

    assert [shape[1] for shape in _run(scenario, schedule).batches] == [2, 5, 3]


def test_without_priorities_the_queue_is_served_in_arrival_order_with_a_request_timeout() -> None:
    """The default policy: one level, REJECT, a request's own timeout honoured."""

    async def scenario(batcher: Batcher, run: Gated, clock: ManualClock) -> None:
        calls = [asyncio.ensure_future(batcher.submit(_x(1, 2)))]
        await _entered(run)
        calls.append(asyncio.ensure_future(batcher.submit(_x(1, 3), timeout_s=0.5)))
        timed = asyncio.ensure_future(batcher.submit(_x(1, 4), timeout_s=0.001))
        calls.append(asyncio.ensure_future(batcher.submit(_x(1, 5))))
        await _until(lambda: batcher.depth == 3)
        clock.advance(0.01)
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(timed, 10)
        run.gate.set()
        await asyncio.gather(*calls)

    assert [shape[1] for shape in _run(scenario, SchedulePolicy()).batches] == [2, 3, 5]
