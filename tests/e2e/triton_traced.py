"""Runs under .venv-triton (tritonclient from PyPI): one inference that continues the caller's trace.

usage: triton_traced.py grpc|http HOST:PORT TRACEPARENT
Sends a (1, 4, C) request with the W3C `traceparent` header, as a traced application would.
"""

import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

protocol, url, traceparent = sys.argv[1:4]
module = grpcclient if protocol == "grpc" else httpclient
client = module.InferenceServerClient(url)
metadata = client.get_model_metadata("mha", as_json=True) if protocol == "grpc" else client.get_model_metadata("mha")
width = int(metadata["inputs"][0]["shape"][-1])
tensor = module.InferInput("x", [1, 4, width], "FP32")
tensor.set_data_from_numpy(np.ones((1, 4, width), np.float32))
result = client.infer("mha", [tensor], headers={"traceparent": traceparent}, request_id="traced-1")
assert result.as_numpy("y").shape == (1, 4, width)
