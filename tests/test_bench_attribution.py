"""bench/attribution.py's reading of `perf script`: samples counted per thread and library group,
and turned into microseconds per request of the main thread and of the others."""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import pytest

from tests.support import ROOT, bench_module

ORT = "/v/site-packages/onnxruntime/capi/onnxruntime_pybind11_state.cpython-311-x86_64-linux-gnu.so"
PYTHON = "/usr/lib/libpython3.11.so.1.0"


def _line(comm: str, tid: int, address: str, symbol: str, library: str) -> str:
    """A sample as `perf script` prints it by default."""
    return f"{comm:>16} {tid}  8160.858414:    1001001 cpu-clock:ppp:  {address:>16} {symbol} ({library})"


PERF_SCRIPT = "\n".join(
    [
        "# ========",
        "# captured on    : Tue Dec  1 23:45:01 2026",
        _line("python", 17074, "7f5ce5614a9f", "[unknown]", ORT),
        _line("python", 17074, "7f5d2b7aedfd", "_PyObject_Free+0x1d", PYTHON),
        _line("python", 17074, "7f5d2b7aedfe", "_PyEval_EvalFrameDefault+0x9", PYTHON),
        _line("python", 17074, "ffffffff8e2a1b2c", "finish_task_switch.isra.0+0x9c", "[kernel.kallsyms]"),
        _line("python", 17093, "7f5ce630330f", "[unknown]", ORT),
        _line("event_engine", 17086, "7f0000000001", "operator delete(void*)+0x1", "/usr/lib/libstdc++.so.6.0.30"),
        " warning: a line perf writes that is not a sample",
    ]
)


@pytest.fixture
def attribution(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # attribution.py imports common and compare
    return bench_module("attribution")


def test_samples_are_counted_by_thread_and_library(attribution: ModuleType) -> None:
    counts = attribution.parse_samples(PERF_SCRIPT)
    assert counts == {
        (17074, "ONNX Runtime"): 1,
        (17074, "Python interpreter"): 2,
        (17074, "kernel"): 1,
        (17093, "ONNX Runtime"): 1,
        (17086, "C and C++ runtime"): 1,  # the library, not the symbol's own parentheses
    }


def test_per_request_splits_the_main_thread_from_its_process_and_the_others(attribution: ModuleType) -> None:
    counts = attribution.parse_samples(PERF_SCRIPT)
    threads = {17074: {17074, 17093}, 17086: {17086}}
    rows = attribution.classify(counts, [17074, 17086], threads.__getitem__)
    us = attribution.per_request(rows, requests=2)
    tick = 1e6 / attribution.FREQUENCY_HZ / 2  # one sample's CPU, shared by the two requests
    assert us["Python interpreter"] == pytest.approx(2 * tick, abs=0.1)
    assert us["main thread, all"] == pytest.approx(4 * tick, abs=0.1)
    assert us["other threads: ONNX Runtime"] == pytest.approx(tick, abs=0.1)
    assert us["other threads, all"] == pytest.approx(tick, abs=0.1)
    assert us["other processes"] == pytest.approx(tick, abs=0.1)  # 17086 is not of the serving process
    assert list(us)[:2] == ["Python interpreter", "ONNX Runtime"]  # the largest first


def test_the_serving_process_is_the_one_whose_main_thread_worked(attribution: ModuleType) -> None:
    """A server of several workers: the supervisor (17000) and the idle worker (17086) did less."""
    counts = attribution.parse_samples(PERF_SCRIPT)
    assert attribution.serving_process(counts, [17000, 17074, 17086]) == 17074
    # its samples summed over every library: 3 in ORT and 1 in Python beat the other worker's 2 in Python
    worker = "\n".join(
        [_line("mha", 301, "7f00", "f", ORT)] * 3
        + [_line("mha", 301, "7f00", "f", PYTHON)]
        + [_line("mha", 302, "7f00", "f", PYTHON)] * 2
    )
    assert attribution.serving_process(attribution.parse_samples(worker), [300, 302, 301]) == 301


def test_the_process_tree_holds_this_process_and_its_children(attribution: ModuleType) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = attribution.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
    finally:
        child.kill()
        child.wait()


def test_each_visit_counts_the_worker_its_client_reached(attribution: ModuleType) -> None:
    """Two visits to a server of two workers, each client reaching another one: both visits'
    work is the main thread's, none of it another process's."""
    first = attribution.parse_samples(_line("mha", 201, "7f00", "f", PYTHON))
    second = attribution.parse_samples(_line("mha", 202, "7f00", "f", PYTHON))
    threads = {201: {201}, 202: {202}}
    rows = attribution.classify(first, [200, 201, 202], threads.__getitem__)
    rows += attribution.classify(second, [200, 201, 202], threads.__getitem__)
    assert rows == {"Python interpreter": 2}
