"""bench/common.py's idle-CPU helpers for bench/compare.py: the machine line says how idle CPUs
wait, and --cpu-latency-qos holds a PM QoS request of 0 µs exactly while its block runs."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import bench_module


def _common() -> ModuleType:
    return bench_module("common")


def _open_fds_on(path: Path) -> int:
    return sum(1 for fd in Path("/proc/self/fd").iterdir() if os.path.realpath(fd) == str(path.resolve()))


def test_the_qos_request_is_held_open_while_the_block_runs(tmp_path: Path) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    with _common().cpu_latency_qos(device):
        assert device.read_bytes() == b"\x00\x00\x00\x00"  # 0 µs, as a 32-bit integer
        assert _open_fds_on(device) == 1  # the request lasts while the file is open
    assert _open_fds_on(device) == 0


def test_a_qos_request_that_cannot_be_made_says_why(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot open"), _common().cpu_latency_qos(tmp_path / "no" / "such"):
        pass


def test_the_idle_policy_names_driver_governor_and_halt_polling(tmp_path: Path) -> None:
    cpuidle = tmp_path / "cpuidle"
    cpuidle.mkdir()
    (cpuidle / "current_driver").write_text("haltpoll\n")
    (cpuidle / "current_governor").write_text("haltpoll\n")
    halt_poll = tmp_path / "guest_halt_poll_ns"
    halt_poll.write_text("0\n")
    common = _common()
    assert common.idle_policy(cpuidle, halt_poll) == "cpuidle haltpoll, haltpoll, guest_halt_poll_ns 0"
    assert common.idle_policy(tmp_path / "none", tmp_path / "none") == "cpuidle unknown"


def test_the_cpu_is_named_with_whether_it_has_avx_512(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC  9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC  9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
    )
    common = _common()
    assert common.cpu_model(cpuinfo) == "AMD EPYC 9R14, AVX-512"
    cpuinfo.write_text("model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\nflags\t\t: fpu sse2 avx2\n")
    assert common.cpu_model(cpuinfo) == "Intel(R) Xeon(R) CPU @ 2.20GHz, no AVX-512"
    assert common.cpu_model(tmp_path / "none") == "CPU unknown"
