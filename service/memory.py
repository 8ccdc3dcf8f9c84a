"""How much memory this process may use: its cgroup's memory limit (a container's `--memory` or a
pod's `resources.limits.memory`), cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`), the
smallest along the hierarchy; else the machine's memory (MemTotal). What the in-flight budget
is derived from by default."""

from __future__ import annotations

import ctypes
from pathlib import Path

from service.cpus import CGROUP_ROOT, SELF_CGROUP, cgroup_limits

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
    limits = cgroup_limits(membership, cgroup_root, "memory", _v2_limit, _v1_limit)
    return int(min(limits)) if limits else _total(meminfo)


def _v2_limit(cgroup: Path) -> float | None:
    try:
        text = (cgroup / "memory.max").read_text().strip()
        return None if text == "max" else float(int(text))
    except (OSError, ValueError):
        return None


def _v1_limit(cgroup: Path) -> float | None:
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


M_MMAP_THRESHOLD = -3  # mallopt(3)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, kept


def freed_buffers_go_back() -> bool:
    """Keep glibc's mmap threshold at 128 KiB. glibc raises it each time a large block is freed
    (up to 32 MiB), after which the blocks of requests and answers come from the heap and stay
    with the process after a burst; a fixed threshold (setting it turns the raising off) keeps
    every block over 128 KiB in a mapping of its own, returned to the system when freed
    (docs/benchmarks.md measures it). False where the C library has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
