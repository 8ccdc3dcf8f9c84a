"""The generated code matches protos/, and the wire matches Triton's own definitions."""

from __future__ import annotations

import json
import subprocess
import sys

from google.protobuf.descriptor import Descriptor

from service.proto import grpc_service_pb2 as pb
from tests.support import ROOT

TRITON_DUMP = """
import json
from tritonclient.grpc import model_config_pb2 as mc, service_pb2 as sv
def fields(d):
    return {f.name: [f.number, f.type, f.label == 3] for f in d.fields}
out = {}
for module in (mc, sv):
    for name, d in module.DESCRIPTOR.message_types_by_name.items():
        out[name] = fields(d)
        for nested in d.nested_types:
            out[name + "." + nested.name] = fields(nested)
service = sv.DESCRIPTOR.services_by_name["GRPCInferenceService"]
out["__rpcs__"] = {m.name: [m.input_type.full_name, m.output_type.full_name] for m in service.methods}
print(json.dumps(out))
"""


def test_generated_code_has_not_drifted() -> None:
    check = [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"]
    run = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"run `make proto` and commit the result: {run.stderr}"


def _ours(d: Descriptor) -> dict[str, list[int]]:
    return {f.name: [f.number, f.type, f.is_repeated] for f in d.fields}


def test_wire_compatible_with_tritonclient() -> None:
    python = ROOT / ".venv-triton" / "bin" / "python"
    run = subprocess.run([str(python), "-c", TRITON_DUMP], capture_output=True, text=True, timeout=120, check=True)
    triton = json.loads(run.stdout)
    checked = 0
    for name, d in pb.DESCRIPTOR.message_types_by_name.items():
        for key, desc in [(name, d)] + [(f"{name}.{n.name}", n) for n in d.nested_types]:
            if desc.GetOptions().map_entry:
                continue
            assert key in triton, f"{key} is not a Triton message"
            for field, spec in _ours(desc).items():
                assert triton[key].get(field) == spec, f"{key}.{field}: ours {spec}, Triton {triton[key].get(field)}"
                checked += 1
    assert checked > 100
    assert pb.DESCRIPTOR.package == "inference"
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.methods:
        assert triton["__rpcs__"][method.name] == [method.input_type.full_name, method.output_type.full_name]
    assert triton["InferParameter"]["double_param"][0] == 4 and triton["InferParameter"]["uint64_param"][0] == 5
