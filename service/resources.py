"""What this container allows the process: CPUs and memory, from its affinity mask and its
cgroups (v1 and v2), and how freed memory goes back to the system.

CPUs: the affinity mask (a container's cpuset), capped by the CPU limit of its cgroups (a
container's `--cpus` or a pod's `resources.limits.cpu`, a CFS quota). A pod limited to 2 CPUs on a
64-core node sees 64 CPUs in its affinity mask; sizing thread pools from that gives 64 threads that
the quota throttles. cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`) are
read; the smallest limit along the hierarchy wins. Unreadable or absent files mean no limit.

Memory: the cgroup's memory limit (a container's `--memory` or a pod's
`resources.limits.memory`), cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`), the
smallest along the hierarchy; else the machine's memory (MemTotal). What the in-flight budget is
derived from by default.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def available_cpus(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs of the affinity mask, at most the cgroup CPU limit rounded up, at least 1."""
    return max(1, math.ceil(cpu_budget(cgroup_root, self_cgroup)))


def cpu_budget(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float:
    """The CPU time this process may take, in CPUs: its affinity mask's size, at most its cgroup
    CPU limit (not rounded: a pod limited to 1.5 CPUs is throttled past 1.5 CPU-seconds a second)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        membership = self_cgroup.read_text()
    except OSError:
        return float(affinity)
    limit = cgroup_cpu_limit(membership, cgroup_root)
    return float(affinity) if limit is None else min(float(affinity), limit)


def cgroup_cpu_limit(membership: str, root: Path) -> float | None:
    """The CPU limit (quota / period) of the cgroups listed in `membership` (the text of
    /proc/self/cgroup) under the mount `root`; None when none is set."""
    limits = cgroup_limits(membership, root, "cpu", _v2_cpu_limit, _v1_cpu_limit)
    return min(limits) if limits else None


Read = Callable[[Path], float | None]


def cgroup_limits(membership: str, root: Path, controller: str, v2: Read, v1: Read) -> list[float]:
    """Every limit that `controller` sets along the cgroups listed in `membership`: read with
    `v2` in the unified hierarchy (cgroup v2), with `v1` in the controller's own mount."""
    limits: list[float] = []
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # cgroup v2: one unified hierarchy
            limits += along_hierarchy(root, path, v2)
        elif controller in controllers.split(","):  # cgroup v1: the controller's mount, or its usual link
            mount = next((m for m in (root / controllers, root / controller) if m.is_dir()), None)
            if mount is not None:
                limits += along_hierarchy(mount, path, v1)
    return limits


def along_hierarchy(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The limits set on `path`'s cgroup and on its ancestors. The mount's root counts too: inside a
    container without a cgroup namespace the path names the host's hierarchy, and the container's
    own cgroup is mounted at the root."""
    relative = Path(path.lstrip("/"))
    found = (read(mount / d) for d in (relative, *relative.parents))
    return [limit for limit in found if limit is not None]


def _v2_cpu_limit(cgroup: Path) -> float | None:
    """cpu.max: "max 100000" (no limit) or "<quota> <period>" in microseconds."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_cpu_limit(cgroup: Path) -> float | None:
    """cpu.cfs_quota_us (-1: no limit) over cpu.cfs_period_us."""
    try:
        quota = int((cgroup / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


MEMINFO = Path("/proc/meminfo")
V1_UNLIMITED = 2**60  # cgroup v1 writes a huge number (a page-rounded 2**63 - 1) for "no limit"


def memory_limit_bytes(
    cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP, meminfo: Path = MEMINFO
) -> int:
    """The cgroup memory limit, else MemTotal, else 4 GiB when neither can be read."""
    try:
        membership = self_cgroup.read_text()
    except OSError:
        membership = ""
    limits = cgroup_limits(membership, cgroup_root, "memory", _v2_memory_limit, _v1_memory_limit)
    return int(min(limits)) if limits else _total(meminfo)


def _v2_memory_limit(cgroup: Path) -> float | None:
    try:
        text = (cgroup / "memory.max").read_text().strip()
        return None if text == "max" else float(int(text))
    except (OSError, ValueError):
        return None


def _v1_memory_limit(cgroup: Path) -> float | None:
    try:
        value = int((cgroup / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return None if value >= V1_UNLIMITED else float(value)


def _total(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 * 2**30


def give_back_freed_memory() -> bool:
    """glibc's malloc_trim(0): the free memory of every malloc arena returned to the system
    (blocking: a few milliseconds for a large heap). glibc keeps freed request and answer buffers
    for the next ones (fast, under load), and would keep them after a burst too; the server calls
    this once it is idle after one (IdleTrim). False where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


@dataclass
class IdleTrim:
    """Whether to give freed memory back now: a burst went through (at least `burst_bytes` held at
    once, its `peak`) and is over (what is held now is under an eighth of that peak). A steady
    load below `burst_bytes` keeps its buffers, for its next requests."""

    burst_bytes: int
    _burst: int = 0  # the largest peak since memory was last given back

    def due(self, held: int, peak: int) -> bool:
        self._burst = max(self._burst, peak)
        if self._burst < self.burst_bytes or held * 8 > self._burst:
            return False
        self._burst = 0
        return True
