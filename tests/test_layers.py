"""Layers hold: what each part imports is what it may know.

service/ is built in layers, lowest first; a module imports only from its own layer or below:

    ground     service/*.py (settings, errors, arrays, logs, metrics, batching primitives)
    backends   service/backends/    compute: ORT, PyTorch, the chain, selection
    decode     service/decode/      incremental decoding: sequences, the step scheduler and runner
    engine     service/engine/      the served model, numpy in and numpy out: door, keeper, batcher
    protocol   service/protocol/    the wire: gRPC, HTTP, protobuf, JSON, status codes, shared memory
    client     service/client/      what a user runs against a server
    app        service/app/         the composition root: server, supervisor, processes
    cli        service/cli.py       the entry point

Every import counts, including those inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT

LAYERS = ("ground", "backends", "decode", "engine", "protocol", "client", "app", "cli")
GENERATED = "service.proto"  # protobuf's generated modules: the wire, at the protocol layer
WIRE_LIBRARIES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "aiohttp")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _service_modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in sorted((ROOT / "service").rglob("*.py"))}
    return {name: path for name, path in found.items() if not (name + ".").startswith(GENERATED + ".")}


def layer_of(module: str) -> str:
    """The layer of a module of service/, from where it lives."""
    if module == GENERATED or module.startswith(GENERATED + "."):
        return "protocol"
    if module == "service.cli":
        return "cli"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS and (ROOT / "service" / parts[1]).is_dir():
        return parts[1]
    if len(parts) <= 2:
        return "ground"
    raise AssertionError(f"{module} lives in no known layer: add its folder to LAYERS in tests/test_layers.py")


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)


def _service_target(name: str, modules: dict[str, Path]) -> str | None:
    """The module of service/ that an imported name refers to (None: not ours)."""
    if name == GENERATED or name.startswith(GENERATED + "."):
        return GENERATED
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _violations() -> list[str]:
    modules = _service_modules()
    found = []
    for module, path in modules.items():
        own = LAYERS.index(layer_of(module))
        for line, name in _imports(path, module):
            target = _service_target(name, modules)
            if target is None or target == "service":
                continue
            if LAYERS.index(layer_of(target)) > own:
                where = f"{path.relative_to(ROOT)}:{line}"
                found.append(f"{where}: {layer_of(module)} imports {target} ({layer_of(target)})")
    return sorted(set(found))


def test_every_module_has_a_layer() -> None:
    layers = {module: layer_of(module) for module in _service_modules()}
    assert len(layers) > 30, "the walk found too few modules"
    assert set(layers.values()) == set(LAYERS), "every layer holds at least one module"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    assert _violations() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The walk itself: a relative import and a name imported from a package both resolve."""
    path = ROOT / "service" / "engine" / "keeper.py"
    names = {name for _, name in _imports(path, "service.engine.keeper")}
    assert "service.engine.door.Batcher" in names
    modules = _service_modules()
    assert _service_target("service.engine.door.Batcher", modules) == "service.engine.door"
    assert _service_target("service.protocol.render", modules) == "service.protocol.render"
    assert LAYERS.index(layer_of("service.protocol.render")) > LAYERS.index(layer_of("service.engine.keeper"))


def _packages_below_the_wire() -> list[str]:
    modules = _service_modules()
    below = LAYERS.index("protocol")
    return sorted(m for m in modules if LAYERS.index(layer_of(m)) < below)


def test_nothing_below_the_wire_imports_grpc_protobuf_or_aiohttp() -> None:
    """Importing every module of ground, backends, decode and engine, in one fresh process."""
    modules = _packages_below_the_wire()
    assert "service.engine.keeper" in modules and "service.decode.scheduler" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(sorted(w for w in {WIRE_LIBRARIES!r} if w in sys.modules)))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"below the wire, imported: {run.stdout.strip()}"


CASES = [
    ("service.client.client", {"torch", "onnx", "onnxruntime", "export.verify"}),  # a client needs no model code
    ("service.protocol.grpc_codec", {"torch", "onnx", "onnxruntime"}),
    ("service.protocol.inference", {"torch", "onnx", "onnxruntime", "grpc", "aiohttp"}),  # no protocol
    ("export.layout", {"torch", "onnx", "onnxruntime", "grpc"}),
    ("model", {"grpc", "onnxruntime", "service"}),  # the model knows no server
    ("service.batch_engine", {"grpc", "torch", "onnxruntime"}),  # batching (queue, plan, merge) knows no model
]


@pytest.mark.parametrize(("module", "forbidden"), CASES, ids=[c[0] for c in CASES])
def test_importing_a_layer_brings_nothing_it_must_not_know(module: str, forbidden: set[str]) -> None:
    code = f"import sys, {module}; print(','.join(sorted(m for m in {sorted(forbidden)!r} if m in sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"{module} imports {run.stdout.strip()}"


DOOR = "service.engine.door"  # the one interface between the wire and the model
VALUES = ("service.decode.control",)  # what a request says of its sequence: a value the door takes


def _past_the_door() -> list[str]:
    """Imports of protocol/ that reach the engine, decoding or the backends other than by the door."""
    modules = _service_modules()
    found = []
    for module, path in modules.items():
        if layer_of(module) != "protocol" or module == GENERATED or module.startswith(GENERATED + "."):
            continue
        for line, name in _imports(path, module):
            target = _service_target(name, modules)
            if target is None or target in (DOOR, *VALUES):
                continue
            if layer_of(target) in ("engine", "decode", "backends"):
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    return sorted(set(found))


def test_the_wire_reaches_the_model_only_through_the_door() -> None:
    assert DOOR in _service_modules()
    assert _past_the_door() == []


def test_the_door_check_sees_a_module_past_the_door() -> None:
    """The walk itself: the servicer's imports resolve, and one of the engine's would be reported."""
    path = ROOT / "service" / "protocol" / "grpc_servicer.py"
    names = {_service_target(name, _service_modules()) for _, name in _imports(path, "service.protocol.grpc_servicer")}
    assert DOOR in names
    assert layer_of("service.engine.keeper") == "engine" and "service.engine.keeper" not in (DOOR, *VALUES)
