"""`mha export` refuses a model it cannot check in this machine's memory (tests/service/test_cli_misuse.py);
the estimate it refuses by must be above what an export really takes (CI saw 10 % more than a
developer machine), but not far above."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from export.grid import parity_peak_bytes
from model import MHAConfig
from model.checkpoint import init_weights, save_checkpoint

PEAK = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def test_the_memory_estimate_is_above_an_export_s_real_peak_and_not_far_above(tmp_path: Path) -> None:
    """Long T (the attention scores dominate): a process of its own, its peak resident set read
    from the kernel's accounting of its one child."""
    config = MHAConfig(d_model=64, n_head=4, max_seq_len=1536)
    export = [sys.executable, "-m", "service.cli", "export", "--out", str(tmp_path / "m"), "--d-model", "64"]
    export += ["--n-head", "4", "--max-seq-len", "1536"]
    run = subprocess.run([sys.executable, "-c", PEAK, *export], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    peak, estimate = int(run.stdout.split()[-1]), parity_peak_bytes(config)
    assert peak <= estimate <= 1.6 * peak, (peak, estimate)


def test_verify_refuses_first_a_model_whose_check_cannot_fit_here(tmp_path: Path) -> None:
    """A model exported on a larger machine: its config, read from the weights' header, is refused
    before the files are checked or any tensor is loaded."""
    config = MHAConfig(d_model=8, n_head=2, max_seq_len=100_000_000)
    save_checkpoint(tmp_path / "weights.safetensors", init_weights(config, seed=0), config)
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "verify", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--max-seq-len 100000000: checking the model against the float64 references needs about" in run.stderr
    assert "Traceback" not in run.stderr
