"""The CPUs a process may use: its affinity mask capped by its cgroups' CPU limit, read from a
cgroup tree written here (v2 and v1 layouts, a container's view and a host's)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from service.resources import available_cpus, cgroup_cpu_limit, cpu_budget


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text)


def test_v2_the_smallest_limit_along_the_hierarchy_wins(tmp_path: Path) -> None:
    _write(tmp_path, cpu__max="max 100000\n")
    _write(tmp_path / "kubepods", cpu__max="150000 100000\n")  # the pod: 1.5 CPUs
    _write(tmp_path / "kubepods" / "pod1", cpu__max="400000 100000\n")  # a looser child
    assert cgroup_cpu_limit("0::/kubepods/pod1\n", tmp_path) == 1.5


def test_v2_without_a_limit_and_unreadable_files_mean_none(tmp_path: Path) -> None:
    _write(tmp_path, cpu__max="max 100000\n")
    _write(tmp_path / "a", cpu__max="garbage\n")
    assert cgroup_cpu_limit("0::/a\n", tmp_path) is None
    assert cgroup_cpu_limit("0::/not/there\n", tmp_path) is None
    assert cgroup_cpu_limit("nonsense\n", tmp_path) is None


def test_v1_a_containers_own_cgroup_is_its_mount_root(tmp_path: Path) -> None:
    """Without a cgroup namespace, /proc/self/cgroup names the host's path, which does not exist
    inside the container; the container's limit is at the mount's root."""
    _write(tmp_path / "cpu,cpuacct", cpu__cfs_quota_us="300000\n", cpu__cfs_period_us="100000\n")
    membership = "5:memory:/kubepods/x\n4:cpu,cpuacct:/kubepods/burstable/pod9/abc\n"
    assert cgroup_cpu_limit(membership, tmp_path) == 3.0
    _write(tmp_path / "cpu,cpuacct", cpu__cfs_quota_us="-1\n")  # no quota
    assert cgroup_cpu_limit(membership, tmp_path) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs an affinity mask")
def test_available_cpus_is_the_affinity_capped_by_the_limit_rounded_up(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    membership = tmp_path / "self_cgroup"
    membership.write_text("0::/pod\n")
    _write(tmp_path / "root" / "pod", cpu__max="50000 100000\n")  # half a CPU: one thread
    assert available_cpus(tmp_path / "root", membership) == 1
    _write(tmp_path / "root" / "pod", cpu__max=f"{(affinity + 4) * 100000} 100000\n")  # more than the mask
    assert available_cpus(tmp_path / "root", membership) == affinity
    _write(tmp_path / "root" / "pod", cpu__max="max 100000\n")
    assert available_cpus(tmp_path / "root", membership) == affinity
    assert available_cpus(tmp_path / "root", tmp_path / "missing") == affinity  # no /proc/self/cgroup


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs an affinity mask")
def test_the_cpu_budget_is_the_limit_unrounded(tmp_path: Path) -> None:
    """A pod limited to 1.5 CPUs gets two threads (available_cpus) but 1.5 CPU-seconds a second:
    what a thread that spins may take is judged by the budget."""
    affinity = len(os.sched_getaffinity(0))
    membership = tmp_path / "self_cgroup"
    membership.write_text("0::/pod\n")
    limit = min(affinity, 2) * 0.75  # 1.5 CPUs on this machine
    _write(tmp_path / "root" / "pod", cpu__max=f"{int(limit * 100000)} 100000\n")
    assert cpu_budget(tmp_path / "root", membership) == limit
    assert available_cpus(tmp_path / "root", membership) == math.ceil(limit)
    _write(tmp_path / "root" / "pod", cpu__max="max 100000\n")
    assert cpu_budget(tmp_path / "root", membership) == affinity
