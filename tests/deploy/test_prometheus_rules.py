"""Alert rules and the example scrape config, checked and unit-tested by promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support import ROOT

PROMTOOL = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool"
RULES = ROOT / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, cwd=RULES, timeout=120)


def test_check_rules() -> None:
    run = promtool("check", "rules", "alerts.yml")
    assert run.returncode == 0 and "SUCCESS: 14 rules found" in run.stdout, run.stdout + run.stderr


def test_rule_unit_tests() -> None:
    run = promtool("test", "rules", "alerts_test.yml")
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_example_scrape_config() -> None:
    run = promtool("check", "config", "prometheus.yml")
    assert run.returncode == 0, run.stdout + run.stderr


def test_rule_tests_fail_when_a_rule_breaks(tmp_path: Path) -> None:
    """The unit tests are not vacuous: a weakened rule makes them fail."""
    broken = (RULES / "alerts.yml").read_text().replace("> 0.05", "> 0.5")
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts_test.yml").write_text((RULES / "alerts_test.yml").read_text())
    run = subprocess.run(
        [str(PROMTOOL), "test", "rules", "alerts_test.yml"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert run.returncode != 0
