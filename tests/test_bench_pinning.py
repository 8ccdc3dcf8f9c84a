"""bench/common.py's CPU pinning, which bench/compare.py uses to give the servers and the load
generator CPUs of their own: the CPU lists it takes, and that what starts inside `on_cpus` runs
there while the caller goes back to where it ran."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import bench_module


def _common() -> ModuleType:
    return bench_module("common")


def _allowed_list(pid: int) -> set[int]:
    """A process's CPUs as the kernel reports them (Cpus_allowed_list, e.g. "0-1,4")."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                low, _, high = part.partition("-")
                cpus.update(range(int(low), int(high or low) + 1))
            return cpus
    raise AssertionError(f"/proc/{pid}/status has no Cpus_allowed_list")


def test_cpu_lists_are_read_as_taskset_writes_them() -> None:
    common = _common()
    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    assert common.cpu_list(str(first)) == {first}
    assert common.cpu_list(f"{first}-{first}") == {first}
    assert common.cpu_list(",".join(str(c) for c in allowed)) == set(allowed)
    for bad in ("", "a", "1-", f"{last}-{first - 1}", "-1", f"{last + 1}"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.cpu_list(bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one of them")
def test_what_starts_on_cpus_runs_there_and_the_caller_goes_back() -> None:
    common = _common()
    before = os.sched_getaffinity(0)
    one = {min(before)}
    seen: dict[str, set[int]] = {}

    def thread_cpus() -> None:
        seen["thread"] = os.sched_getaffinity(0)

    with common.on_cpus(one):
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        thread = threading.Thread(target=thread_cpus)
        thread.start()
        thread.join()
    try:
        assert _allowed_list(child.pid) == one  # a server started inside
        assert seen["thread"] == one  # and a thread (ORT's pool, the load generator's clients)
        assert os.sched_getaffinity(0) == before  # the caller runs where it ran before
    finally:
        child.communicate(b"", timeout=30)
    with common.on_cpus(None):
        assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one of them")
def test_a_thread_that_pins_itself_elsewhere_is_named() -> None:
    """ORT's default pool pins a thread to every core of the machine, out of the CPUs a server
    was started on: compare.py must say so rather than count that CPU as the server's own."""
    common = _common()
    inside, elsewhere = sorted(os.sched_getaffinity(0))[:2]
    script = (
        "import os, sys, threading\n"
        "escape = sys.argv[1] == 'escape'\n"
        "done = threading.Event()\n"
        "def pool():\n"
        f"    if escape: os.sched_setaffinity(0, {{{elsewhere}}})\n"
        "    print('started', flush=True)\n"
        "    done.wait()\n"
        "threading.Thread(target=pool, name='pool', daemon=True).start()\n"
        "sys.stdin.read()\n"
    )
    for mode, expected in (("stay", 0), ("escape", 1)):
        with common.on_cpus({inside}):
            child = subprocess.Popen(
                [sys.executable, "-c", script, mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        try:
            assert child.stdout is not None and child.stdout.readline() == "started\n"
            outside = common.threads_outside(child.pid, {inside})
            assert len(outside) == expected, outside
            assert all(f"CPUs [{elsewhere}]" in line for line in outside)
        finally:
            child.communicate("", timeout=30)
