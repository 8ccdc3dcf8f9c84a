"""The test helpers' own promises, where a broken helper would make other tests hang or pass."""

from __future__ import annotations

import threading

import numpy as np

from tests.support import ComputeGate


def test_a_gate_holds_the_next_compute_until_ready_and_only_that_one() -> None:
    gate = ComputeGate(held=())
    release = threading.Event()
    gate.hold_next(release.is_set)
    x = [np.zeros((2, 3, 4), np.float32)]
    worker = threading.Thread(target=gate, args=("batch", x))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive() and gate.computed == [], "the held compute went on before it was ready"
    release.set()
    worker.join(10)
    gate("steps", x)  # the next is not held
    assert gate.computed == [("batch", 2), ("steps", 2)]


def test_a_gate_raises_for_a_poisoned_input_only() -> None:
    gate = ComputeGate(held=(), poison=7.0)
    gate("batch", [np.zeros((1, 2, 4), np.float32)])
    try:
        gate("batch", [np.full((1, 2, 4), 7.0, np.float32)])
    except RuntimeError as exc:
        assert "poisoned" in str(exc)
    else:
        raise AssertionError("a poisoned input computed")
