"""The type and lint checks of `make lint`, run by the suite so that CI runs them too.

mypy covers bench/ as well as the packages: bench's scripts call the service's own functions and
are run by hand, so a signature that moves would otherwise leave one broken until someone runs it
(bench/request_path.py was, twice).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

BIN = Path(sys.executable).parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_passes_on_the_packages_and_bench(tmp_path: Path) -> None:
    result = _run(str(BIN / "mypy"), "--cache-dir", str(tmp_path / "cache"))  # its files: pyproject.toml
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_lint_and_format_pass() -> None:
    for command in (("check", "."), ("format", "--check", ".")):
        result = _run(str(BIN / "ruff"), *command)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_no_child_process_runs_python_between_fork_and_exec() -> None:
    """`preexec_fn` runs Python in the forked child before it execs; where this process's gRPC
    threads are at work, gRPC's event engine can abort that child (SIGABRT, 'epoll_wait error: Bad
    file descriptor': about one start in fifty under load). A child sets up itself instead, as
    `mha serve --parent-pid` does."""
    found = []
    for folder in ("model", "export", "service", "bench", "tests", "deploy"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                    found.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not found, found
