"""Runs under .venv-triton: one tritonclient channel sends N stateless requests, as a user does.

usage: triton_spread.py HOST:PORT N
Exits non-zero on any error; the test reads where the requests went from each replica's /metrics.
"""

import sys

import numpy as np
import tritonclient.grpc as grpcclient

url, count = sys.argv[1], int(sys.argv[2])
client = grpcclient.InferenceServerClient(url)  # one channel: one HTTP/2 connection to the balancer
x = np.ones((1, 4, 32), np.float32)
for _ in range(count):
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    assert client.infer("mha", [tensor]).as_numpy("y").shape == x.shape
client.close()
