"""bench/gpu_check.py, the one script for a lent device, checked here where it can be: its results
survive a failing section."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.support import ROOT


def test_the_gpu_script_keeps_each_section_even_when_one_fails(tmp_path: Path) -> None:
    """A lent device is scarce: an exception in one section must not lose the others."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    results = gpu_check.Results(tmp_path / "gpu_check.json")
    with results.section("first") as entry:
        entry["value"] = 1
    assert json.loads((tmp_path / "gpu_check.json").read_text())["first"]["value"] == 1  # written at once
    with results.section("broken") as entry:
        raise RuntimeError("CUDA error: out of memory")
    with results.section("after") as entry:
        entry["value"] = 3
    seen = json.loads((tmp_path / "gpu_check.json").read_text())
    assert seen["broken"]["error"] == "RuntimeError: CUDA error: out of memory" and seen["after"]["value"] == 3
