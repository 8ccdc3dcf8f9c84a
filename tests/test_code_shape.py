"""Shape rules a reviewer can rerun: no class of 150 lines or more, servicer methods of at most 15."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("model", "export", "service")
GENERATED = ROOT / "service" / "proto"


def _modules() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED not in path.parents:
                yield path


def _classes(path: Path) -> Iterator[ast.ClassDef]:
    yield from (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef))


def _length(node: ast.AST) -> int:
    return int(node.end_lineno) - int(node.lineno) + 1  # type: ignore[attr-defined]


def test_no_class_reaches_150_lines() -> None:
    sizes = {f"{p.relative_to(ROOT)}:{c.name}": _length(c) for p in _modules() for c in _classes(p)}
    assert sizes, "no classes found: the walk is broken"
    assert max(sizes.values()) < 150, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_servicer_methods_are_a_few_lines() -> None:
    (servicer,) = [
        c for c in _classes(ROOT / "service" / "protocol" / "grpc_servicer.py") if c.name == "InferenceServicer"
    ]
    methods = {f.name: _length(f) for f in servicer.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert len(methods) >= 10
    assert max(methods.values()) <= 15, {k: v for k, v in methods.items() if v > 15}
