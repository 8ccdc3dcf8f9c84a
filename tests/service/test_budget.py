"""The in-flight budget, alone, and the memory limit it is derived from (cgroup trees written
here, v2 and v1, and /proc/meminfo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.budget import MIB, InflightBudget
from service.errors import Overloaded, TooLarge
from service.resources import memory_limit_bytes


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
