"""Generate service/proto/ from protos/*.proto with grpcio-tools (`make proto`); `--check` lists
the generated files that differ from what the sources generate now, and exits 1 if any does.
A development tool, not part of the installed package."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("grpc_service.proto",)
OUTPUTS = ("grpc_service_pb2.py", "grpc_service_pb2.pyi", "grpc_service_pb2_grpc.py")
log = logging.getLogger(__name__)


def generate(out_root: Path) -> Path:
    """Write the generated modules under out_root/service/proto/ and return that folder."""
    from grpc_tools import protoc

    # Mapping the include path to service/proto makes the generated imports package-qualified.
    args = [
        "grpc_tools.protoc",
        f"-Iservice/proto={ROOT / 'protos'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"service/proto/{name}" for name in SOURCES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return out_root / "service" / "proto"


def drift() -> list[str]:
    """Names of generated files that differ from what the .proto sources generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        here = ROOT / "service" / "proto"
        return [n for n in OUTPUTS if not (here / n).exists() or (here / n).read_bytes() != (fresh / n).read_bytes()]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if sys.argv[1:] == ["--check"]:
        drifted = drift()
        for name in drifted:
            log.error("service/proto/%s differs from what protos/ generates: run `make proto`", name)
        return 1 if drifted else 0
    out = generate(ROOT)
    (out / "__init__.py").write_text('"""Generated from protos/ by `make proto`; do not edit."""\n')
    log.info("generated %s", ", ".join(OUTPUTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
