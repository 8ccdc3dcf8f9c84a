"""Alert rules and the example scrape config, checked and unit-tested by promtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support import ROOT

PROMTOOL = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool"
RULES = ROOT / "deploy" / "prometheus"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_PAGE = "https://github.com/mha-serve/mha-serve/blob/main/docs/runbooks.md"  # the chart's default too


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, cwd=RULES, timeout=120)


def test_check_rules() -> None:
    run = promtool("check", "rules", "alerts.yml")
    assert run.returncode == 0 and "SUCCESS: 31 rules found" in run.stdout, run.stdout + run.stderr


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


def test_every_alert_links_its_own_runbook_section() -> None:
    """Each alert's runbook_url is its section of docs/runbooks.md, at the anchor GitHub gives a
    heading (its text in lower case), and every section is an alert's: none missing, none left
    after its alert went. Each says what the alert means, how to check it and what to do."""
    text = RUNBOOKS.read_text()
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections == [rule["alert"] for rule in alert_rules()]  # in the order of alerts.yml
    for rule in alert_rules():
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_PAGE}#{rule['alert'].lower()}", rule["alert"]
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        assert all(part in section for part in ("**Means", "**Check", "**Act")), section.splitlines()[0]
