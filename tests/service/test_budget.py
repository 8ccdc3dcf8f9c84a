"""The in-flight budget, alone, and the memory limit it is derived from (cgroup trees written
here, v2 and v1, and /proc/meminfo); freed memory given back once the server is idle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from service.app.server import TRIM_EVERY_S, give_back_when_idle
from service.budget import MIB, InflightBudget
from service.errors import Overloaded, TooLarge
from service.resources import IdleTrim, give_back_freed_memory, memory_limit_bytes


def test_a_lease_grows_until_the_request_alone_or_the_server_is_full() -> None:
    """A body read as it arrives: one lease, grown step by step. Its own total past the whole
    budget is TooLarge (never fits); a step that fits it but not beside the others, Overloaded."""
    budget = InflightBudget(8 * MIB)
    body = budget.take(3 * MIB, "its body")
    body.grow(3 * MIB, "its body")
    assert (budget.held, body.nbytes) == (6 * MIB, 6 * MIB)
    with pytest.raises(TooLarge, match=r"needs 9.0 MiB in flight \(its body\), more than this server's whole"):
        body.grow(3 * MIB, "its body")
    assert budget.held == 6 * MIB  # a refused step takes nothing
    other = budget.take(2 * MIB)
    with pytest.raises(Overloaded, match="retry shortly") as info:
        body.grow(MIB, "its body")
    assert not isinstance(info.value, TooLarge)
    other.release()
    body.grow(MIB, "its body")
    body.release()
    assert budget.held == 0  # every step given back with it


def test_leases_add_up_to_the_limit_and_go_back_once() -> None:
    budget = InflightBudget(10 * MIB)
    first, second = budget.take(4 * MIB), budget.take(6 * MIB)
    assert budget.held == 10 * MIB
    with pytest.raises(Overloaded, match=r"holds 10 MiB .* needs 1.0 MiB more; its limit is 10 MiB") as info:
        budget.take(MIB)
    assert not isinstance(info.value, TooLarge)  # full now: retry later
    first.release()
    first.release()  # a second release gives nothing back twice
    assert budget.held == 6 * MIB
    budget.take(4 * MIB)
    second.release()
    assert budget.held == 4 * MIB


def test_one_request_over_the_whole_budget_can_never_fit() -> None:
    budget = InflightBudget(MIB)
    with pytest.raises(TooLarge, match=r"needs 2.0 MiB in flight \(its body\).*split the batch"):
        budget.take(2 * MIB, "its body")
    assert budget.held == 0


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text)


def test_the_smallest_cgroup_memory_limit_along_the_hierarchy(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    cgroup = tmp_path / "cgroup"
    _write(cgroup, memory__max="max\n")
    _write(cgroup / "kubepods", memory__max=f"{4 * 2**30}\n")
    _write(cgroup / "kubepods" / "pod1", memory__max="max\n")
    membership = tmp_path / "self"
    membership.write_text("0::/kubepods/pod1\n")
    assert memory_limit_bytes(cgroup, membership, meminfo) == 4 * 2**30
    membership.write_text("0::/elsewhere\n")  # no limit on the way: the machine's memory
    assert memory_limit_bytes(cgroup, membership, meminfo) == 16384000 * 1024


def test_cgroup_v1_and_its_unlimited_value(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2048 kB\n")
    v1 = tmp_path / "cgroup"
    _write(v1 / "memory", memory__limit_in_bytes=f"{2**63 - 4096}\n")  # what v1 writes for no limit
    membership = tmp_path / "self"
    membership.write_text("7:memory:/docker/abc\n")
    assert memory_limit_bytes(v1, membership, meminfo) == 2048 * 1024
    _write(v1 / "memory", memory__limit_in_bytes=f"{512 * MIB}\n")  # a container's own cgroup, at the root
    assert memory_limit_bytes(v1, membership, meminfo) == 512 * MIB
    assert memory_limit_bytes(v1, tmp_path / "absent", tmp_path / "absent") == 4 * 2**30


def test_the_peak_is_the_most_held_at_once_since_the_last_look() -> None:
    budget = InflightBudget(16 * MIB)
    body = budget.take(2 * MIB, "its body")
    body.grow(MIB, "its body")
    answer = budget.take(3 * MIB)
    body.release()
    assert budget.peak_since() == 6 * MIB
    assert budget.peak_since() == 3 * MIB  # counted anew from what is held now
    answer.release()
    assert (budget.peak_since(), budget.peak_since()) == (3 * MIB, 0)


def test_memory_is_given_back_once_a_burst_is_over() -> None:
    """IdleTrim: due once a peak of at least the burst's size has fallen under an eighth."""
    idle = IdleTrim(burst_bytes=16 * MIB)
    assert not idle.due(held=0, peak=8 * MIB)  # a steady load below a burst keeps its buffers
    assert not idle.due(held=20 * MIB, peak=32 * MIB)  # a burst, still on
    assert not idle.due(held=5 * MIB, peak=10 * MIB)  # falling, but above an eighth of its peak
    assert idle.due(held=4 * MIB, peak=4 * MIB)  # over: the burst's peak is remembered
    assert not idle.due(held=0, peak=0)  # given back once
    assert not idle.due(held=0, peak=15 * MIB)
    assert idle.due(held=MIB, peak=16 * MIB)


def test_the_server_gives_memory_back_when_a_burst_is_over() -> None:
    """give_back_when_idle on an injected sleep: a 24 MiB burst in flight over two looks, then
    gone; the memory goes back once, at the first look after it, and not again."""
    budget, trims, looks = InflightBudget(64 * MIB), [], []
    leases = []

    async def sleep(seconds: float) -> None:
        looks.append(seconds)
        if len(looks) == 1:
            leases.extend(budget.take(8 * MIB) for _ in range(3))
        elif len(looks) == 3:
            for lease in leases:
                lease.release()
        elif len(looks) == 6:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(give_back_when_idle(budget, sleep, lambda: trims.append(len(looks))))
    assert trims == [3]
    assert looks == [TRIM_EVERY_S] * 6


def test_glibc_gives_freed_memory_back_here() -> None:
    assert give_back_freed_memory()  # glibc's malloc_trim, on the Linux CI machine
