"""Layers hold: what each part imports is what it may know."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

CASES = [
    ("service.client", {"torch", "onnx", "onnxruntime", "export.verify"}),  # a client needs no model code
    ("service.codec", {"torch", "onnx", "onnxruntime"}),
    ("export.layout", {"torch", "onnx", "onnxruntime", "grpc"}),
    ("model", {"grpc", "onnxruntime", "service"}),  # the model knows no server
    ("service.batcher", {"grpc", "torch", "onnxruntime"}),  # the batcher knows no gRPC
]


@pytest.mark.parametrize(("module", "forbidden"), CASES, ids=[c[0] for c in CASES])
def test_importing_a_layer_brings_nothing_it_must_not_know(module: str, forbidden: set[str]) -> None:
    code = f"import sys, {module}; print(','.join(sorted(m for m in {sorted(forbidden)!r} if m in sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"{module} imports {run.stdout.strip()}"
