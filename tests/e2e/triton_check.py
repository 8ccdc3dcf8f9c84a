"""Runs under .venv-triton (tritonclient from PyPI): drives a running mha-serve like Triton's users do.

usage: triton_check.py HOST:PORT OUT.json
Prints nothing on success; writes what it saw as JSON for the test to assert on.
"""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

url, out_path = sys.argv[1], sys.argv[2]
client = grpcclient.InferenceServerClient(url=url)
seen = {
    "live": client.is_server_live(),
    "ready": client.is_server_ready(),
    "model_ready": client.is_model_ready("mha"),
}
meta = client.get_model_metadata("mha", as_json=True)
seen["metadata"] = meta
seen["config"] = client.get_model_config("mha", as_json=True)
seen["server_metadata"] = client.get_server_metadata(as_json=True)

rng = np.random.default_rng(5)
C = int(meta["inputs"][0]["shape"][-1])
inputs_seen = []
for B, T in [(1, 1), (2, 13), (3, 64)]:
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("mha", [tensor], outputs=[grpcclient.InferRequestedOutput("y")], request_id=f"u{B}")
    inputs_seen.append({"x": x.tolist(), "y": result.as_numpy("y").tolist(), "id": result.get_response().id})
seen["unary"] = inputs_seen

responses: queue.Queue = queue.Queue()
client.start_stream(callback=lambda result, error: responses.put((result, error)))
stream_inputs = {}
for i, T in enumerate([2, 7, 31]):
    x = rng.standard_normal((1, T, C), dtype=np.float32)
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    stream_inputs[f"s{i}"] = x
    client.async_stream_infer("mha", [tensor], request_id=f"s{i}")
stream_seen = []
for _ in stream_inputs:
    result, error = responses.get(timeout=60)
    if error is not None:
        stream_seen.append({"error": str(error)})
        continue
    rid = result.get_response().id
    stream_seen.append({"id": rid, "x": stream_inputs[rid].tolist(), "y": result.as_numpy("y").tolist()})
client.stop_stream()
seen["stream"] = stream_seen

try:
    bad = grpcclient.InferInput("x", [1, 4, C + 1], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 4, C + 1), np.float32))
    client.infer("mha", [bad])
    seen["bad"] = None
except grpcclient.InferenceServerException as exc:
    seen["bad"] = {"status": exc.status(), "message": exc.message()}

with open(out_path, "w") as f:
    json.dump(seen, f)
