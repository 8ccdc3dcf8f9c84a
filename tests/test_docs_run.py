"""Every snippet in README.md and docs/ runs as written (issue 36).

Each fenced block carries a marker on the line before it, `<!-- doc-test: MODE -->`:
- `run`: executed against a live server of the default model (HTTP on, system shared memory on),
  its ports translated as a user would (8001 gRPC, 8000 HTTP, 8002 metrics); `run repository`:
  against a server in explicit model-control mode over a repository; `run offline`: no server.
  Shell blocks run in bash with `-e` (and curl with `-f`: an HTTP error fails); Python blocks in
  the environment they import from (tritonclient's own, or the project's). A Python line that
  states a shape in its comment (`y = ...  # (2, 64, 128)`) is checked to hold it.
- `pbtxt`: read by the server's own config.pbtxt reader.
- `elsewhere: TEST`: a test of that name runs it (it must exist).
- `not-here: WHY`: needs Docker, Kubernetes or a GPU; rendered or linted by tests/deploy.
A block without a marker fails the suite: every new snippet is classified when it is written.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from service.app.model_config import read_policy, read_schedule
from service.engine.sources import VersionPolicy
from service.metrics import Metrics
from service.settings import Settings, schedule_policy
from tests.support import ROOT, server_process

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<mode>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
SHAPE_COMMENT = re.compile(r"#\s*\((\d+(?:, \d+)+)\)")
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"


def _blocks() -> list[tuple[str, str, str, str]]:
    """(where, mode, language, body) of every fenced block."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text[: m.start('lang')].count(chr(10)) + 1}"
            found.append((where, m.group("mode") or "", m.group("lang"), m.group("body")))
    return found


BLOCKS = _blocks()
DOCS_TEXT = "\n".join(path.read_text() for path in DOCS)


def _of(mode: str) -> list[tuple[str, str, str]]:
    return [(where, lang, body) for where, m, lang, body in BLOCKS if m == mode]


def test_every_block_is_classified() -> None:
    assert len(BLOCKS) >= 19, "the extraction found fewer blocks than the docs hold"
    unmarked = [where for where, mode, _, _ in BLOCKS if not mode]
    assert unmarked == [], f"give these a <!-- doc-test: ... --> marker: {unmarked}"
    known = ("run", "run repository", "run offline", "pbtxt")
    odd = [(w, m) for w, m, _, _ in BLOCKS if m not in known and not m.startswith(("elsewhere: ", "not-here: "))]
    assert odd == []


def test_the_tests_named_elsewhere_exist() -> None:
    """`elsewhere:` names a test function, or a test module, that runs the block."""
    files = list((ROOT / "tests").rglob("test_*.py"))
    sources = "\n".join(p.read_text() for p in files)
    for where, mode, _, _ in BLOCKS:
        name = mode.removeprefix("elsewhere: ")
        if mode.startswith("elsewhere: "):
            assert re.search(rf"\bdef {name}\b", sources) or name in {p.stem for p in files}, (where, name)


def test_the_policy_examples_read_as_triton_writes_them(tmp_path: Path) -> None:
    """The version policy example, and the schedule policy example equal to the flags shown beside it."""
    versions, schedule = [body for _, _, body in _of("pbtxt")]
    (tmp_path / "config.pbtxt").write_text(versions)
    assert read_policy(tmp_path) == VersionPolicy("latest", count=2)
    (tmp_path / "mha").mkdir()
    (tmp_path / "mha" / "config.pbtxt").write_text(schedule)
    flags = re.search(r'--priority-levels (\d+) --default-priority-level (\d+) --queue-policy\s+"([^"]+)"', DOCS_TEXT)
    assert flags is not None, "the flags beside the schedule example"
    levels, default, policy = flags.groups()
    shown = Settings(priority_levels=int(levels), default_priority_level=int(default), queue_policy=policy)
    assert read_schedule(Settings(model_repository=tmp_path)) == schedule_policy(shown)
    assert schedule_policy(shown).priority_levels == 2


def _translated(text: str, ports: dict[int, int]) -> str:
    for documented, actual in ports.items():
        text = re.sub(rf"\b(127\.0\.0\.1|localhost):{documented}\b", f"127.0.0.1:{actual}", text)
    text = text.replace(".venv/bin/", f"{ROOT}/.venv/bin/")
    return re.sub(r"\bcurl -s\b", "curl -sf", text)


def _with_shape_checks(code: str) -> str:
    """The block, with an assertion after each assignment whose comment states its shape."""
    lines = code.splitlines()
    checks: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.end_lineno:
            stated = SHAPE_COMMENT.search(lines[node.end_lineno - 1])
            if stated:
                name, shape = node.targets[0].id, f"({stated.group(1)})"
                checks.append((node.end_lineno, f"assert {name}.shape == {shape}, {name}.shape"))
    for line, check in sorted(checks, reverse=True):
        indent = re.match(r"\s*", lines[line - 1]).group(0)  # type: ignore[union-attr]
        lines.insert(line, indent + check)
    return "\n".join(lines) + "\n"


def _run(where: str, lang: str, body: str, ports: dict[int, int], cwd: Path) -> None:
    text = _translated(body, ports)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if lang == "python":
        python = TRITON_PYTHON if "tritonclient" in text else ROOT / ".venv" / "bin" / "python"
        command = [str(python), "-c", _with_shape_checks(text)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", text]
    run = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (where, text, run.stdout[-1500:], run.stderr[-2500:])


@pytest.fixture(scope="module")
def default_server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, int]]:
    log = tmp_path_factory.mktemp("doc-server") / "server.log"
    args = ["--model-dir", str(default_model_dir), "--shared-memory", "system", "--backend", "ort-cpu"]
    with server_process(args, log) as server:
        yield {8001: server.port, 8000: server.http_port, 8002: server.metrics_port}


@pytest.mark.parametrize(("where", "lang", "body"), _of("run"), ids=[w for w, _, _ in _of("run")])
def test_a_snippet_runs_against_a_live_server(
    where: str, lang: str, body: str, default_server: dict[int, int], tmp_path: Path
) -> None:
    _run(where, lang, body, default_server, tmp_path)


def test_the_repository_calls_run_against_a_server_in_explicit_mode(default_model_dir: Path, tmp_path: Path) -> None:
    (repository := tmp_path / "repo" / "mha").mkdir(parents=True)
    (repository / "1").symlink_to(default_model_dir)
    args = ["--model-repository", str(tmp_path / "repo"), "--model-control-mode", "explicit", "--load-model", "mha"]
    with server_process([*args, "--backend", "ort-cpu"], tmp_path / "server.log") as server:
        for where, lang, body in _of("run repository"):
            _run(where, lang, body, {8001: server.port, 8000: server.http_port}, tmp_path)


@pytest.mark.parametrize(("where", "lang", "body"), _of("run offline"), ids=[w for w, _, _ in _of("run offline")])
def test_a_snippet_runs_without_a_server(where: str, lang: str, body: str, tmp_path: Path) -> None:
    _run(where, lang, body, {}, tmp_path)


def _table_names(section: str, pattern: str) -> set[str]:
    """Names in the first cell of the table rows of docs/operations.md's `section` that match `pattern`."""
    text = (ROOT / "docs" / "operations.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(pattern, row.split("|")[1])}


def test_every_flag_is_documented_and_every_documented_flag_exists() -> None:
    flags = {f"--{f.name.replace('_', '-')}" for f in fields(Settings) if f.metadata["flag"]} | {"--log-level"}
    help_text = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "mha"), "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert flags - {"--log-level"} <= set(re.findall(r"(--[a-z0-9-]+)", help_text))  # what --help lists
    documented = _table_names("Configuration", r"`(--[a-z0-9-]+)")
    assert flags - documented == set(), "flags missing from docs/operations.md's configuration table"
    assert documented - flags == set(), "flags documented that `mha serve` does not take"


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in registry.collect()}
    exported = {name for name in exported if name.startswith(("mha_", "nv_"))} | {"mha_worker_restarts_total"}
    documented = _table_names("Metrics, dashboard and alerts", r"`((?:mha|nv)_[a-z_]+)")
    assert exported - documented == set(), "metrics missing from docs/operations.md's metrics table"
    assert documented - exported == set(), "metrics documented that the server does not export"


def test_every_shell_block_parses() -> None:
    """The blocks not run here (Docker, Kubernetes, Helm, make) are at least valid bash."""
    for where, _, lang, body in BLOCKS:
        if lang in ("sh", "bash"):
            run = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True, timeout=30)
            assert run.returncode == 0, (where, run.stderr)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but hyphens and
    underscores dropped, spaces as hyphens, a repeated one numbered."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen[slug] = seen.get(slug, -1) + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_relative_link_in_the_docs_leads_somewhere() -> None:
    """A link between our pages names a file that exists and, in a Markdown file, a heading it has:
    the runbooks and the docs send readers to one another's sections."""
    broken = []
    for page in [*DOCS, ROOT / "bench" / "RESULTS.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append((page.name, target, "no such file"))
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append((page.name, target, "no such heading"))
    assert not broken, broken
