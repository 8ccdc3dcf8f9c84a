"""How many CPUs this process may use: its affinity mask (a container's cpuset), capped by the CPU
limit of its cgroups (a container's `--cpus` or a pod's `resources.limits.cpu`, a CFS quota).

A pod limited to 2 CPUs on a 64-core node sees 64 CPUs in its affinity mask; sizing thread pools
from that gives 64 threads that the quota throttles. cgroup v2 (`cpu.max`) and v1
(`cpu.cfs_quota_us` / `cpu.cfs_period_us`) are read; the smallest limit along the hierarchy wins.
Unreadable or absent files mean no limit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
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
    limits = cgroup_limits(membership, root, "cpu", _v2_limit, _v1_limit)
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


def _v2_limit(cgroup: Path) -> float | None:
    """cpu.max: "max 100000" (no limit) or "<quota> <period>" in microseconds."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_limit(cgroup: Path) -> float | None:
    """cpu.cfs_quota_us (-1: no limit) over cpu.cfs_period_us."""
    try:
        quota = int((cgroup / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None
