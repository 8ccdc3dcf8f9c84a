"""Every benchmark script answers --help and nothing more: it describes itself without running
(a --help that measured would rewrite bench/results/ behind the reader's back)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name != "common.py")


def _results() -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").rglob("*") if p.is_file()}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help_describes_and_runs_nothing(script: Path) -> None:
    before = _results()
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:"), run.stdout[:500]
    assert _results() == before, "--help wrote results"
