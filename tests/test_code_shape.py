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


MAX_COLLABORATORS = 8


VALUES = {"int", "float", "str", "bool", "bytes", "Path", "None", "tuple", "list", "dict", "set", "frozenset"}


def _names(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}


def _held(cls: ast.ClassDef) -> set[str]:
    """The parts a class's instances hold: every `self.x = ...` in its methods, and the fields of a
    dataclass or named tuple that are not plain values (numbers, strings, paths, and their
    containers: a settings record is one part, however many values it has)."""
    held = set()
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for name in target.elts if isinstance(target, ast.Tuple) else [target]:  # self.x, self.y = ...
                if isinstance(name, ast.Attribute) and isinstance(name.value, ast.Name) and name.value.id == "self":
                    held.add(name.attr)
    for field in cls.body:
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and not _names(field.annotation) <= VALUES
        ):
            held.add(field.target.id)
    return held


def test_no_object_holds_more_than_eight_collaborators() -> None:
    """An object that holds more parts than this is several objects: split it, or group the parts
    that belong together under the name of what they are."""
    classes = [(f"{p.relative_to(ROOT)}:{c.name}", c) for p in _modules() for c in _classes(p)]
    own = {c.name: _held(c) for _, c in classes}  # class names are unique in these packages
    bases = {
        c.name: [b.value.id if isinstance(b, ast.Subscript) else getattr(b, "id", "") for b in c.bases]
        for _, c in classes
    }

    def inherited(name: str) -> set[str]:
        return own.get(name, set()).union(*(inherited(base) for base in bases.get(name, []) if base in own))

    held = {where: inherited(c.name) for where, c in classes}
    assert len(held["service/engine/door.py:Door"]) >= 5, "the count is broken: the door holds its parts"
    assert held["service/engine/door.py:Batcher"] > own["BatchEngine"], (
        "the count is broken: a subclass holds its base's"
    )
    crowded = {name: sorted(attrs) for name, attrs in held.items() if len(attrs) > MAX_COLLABORATORS}
    assert crowded == {}, crowded


def _functions_taking_a_class_of_their_module(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    behaviours = {  # classes that build their own state: the objects a module function must not stand in for
        c.name
        for c in tree.body
        if isinstance(c, ast.ClassDef) and any(isinstance(f, ast.FunctionDef) and f.name == "__init__" for f in c.body)
    }
    found = []
    for function in (n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        first = function.args.args[:1]
        if first and _names(first[0].annotation) & behaviours:
            found.append(f"{path.relative_to(ROOT)}:{function.name}({first[0].arg})")
    return found


def test_no_module_function_stands_in_for_a_method() -> None:
    """The class-size rule is kept by splitting classes, not by moving their methods out into
    module functions that take the object as their first argument (`_audited(core, ...)`)."""
    found = [f for p in _modules() for f in _functions_taking_a_class_of_their_module(p)]
    assert found == [], found
