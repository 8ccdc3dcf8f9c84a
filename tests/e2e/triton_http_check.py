"""Runs under .venv-triton (tritonclient[http] from PyPI): drives mha-serve's HTTP/REST endpoint.

usage: triton_http_check.py HOST:PORT OUT.json
Prints nothing on success; writes what it saw as JSON for the test to assert on.
"""

import json
import sys

import numpy as np
import tritonclient.http as httpclient

url, out_path = sys.argv[1], sys.argv[2]
client = httpclient.InferenceServerClient(url=url)
seen = {
    "live": client.is_server_live(),
    "ready": client.is_server_ready(),
    "model_ready": client.is_model_ready("mha"),
    "version_ready": client.is_model_ready("mha", "1"),
    "unknown_ready": client.is_model_ready("bert"),
    "metadata": client.get_model_metadata("mha"),
    "config": client.get_model_config("mha"),
    "server_metadata": client.get_server_metadata(),
}
rng = np.random.default_rng(6)
C = int(seen["metadata"]["inputs"][0]["shape"][-1])
unary = []
for i, (B, T, binary_in, binary_out) in enumerate([(1, 1, True, True), (2, 13, False, False), (3, 64, True, False)]):
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary_in)
    outputs = [httpclient.InferRequestedOutput("y", binary_data=binary_out)]
    result = client.infer("mha", [tensor], outputs=outputs, request_id=f"h{i}")
    unary.append({"x": x.tolist(), "y": result.as_numpy("y").tolist(), "id": result.get_response()["id"]})
x = rng.standard_normal((1, 5, C), dtype=np.float32)
tensor = httpclient.InferInput("x", list(x.shape), "FP32")
tensor.set_data_from_numpy(x)
result = client.infer("mha", [tensor], model_version="1")  # no outputs named: binary_data_output
unary.append({"x": x.tolist(), "y": result.as_numpy("y").tolist(), "id": ""})
seen["unary"] = unary
seen["stats"] = client.get_inference_statistics("mha")

mistakes = {}
for name, shape, model in [("C", [1, 4, C + 1], "mha"), ("T", [1, 1025, C], "mha"), ("model", [1, 2, C], "bert")]:
    bad = httpclient.InferInput("x", shape, "FP32")
    bad.set_data_from_numpy(np.zeros(shape, np.float32))
    try:
        client.infer(model, [bad])
        mistakes[name] = None
    except httpclient.InferenceServerException as exc:
        mistakes[name] = {"status": exc.status(), "message": exc.message()}
seen["mistakes"] = mistakes

with open(out_path, "w") as f:
    json.dump(seen, f)
