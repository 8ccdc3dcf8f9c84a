"""Runs under .venv-triton (tritonclient from PyPI): Triton's clients over TLS, as their users
connect, to a server whose certificate a test renews while they run.

usage: triton_tls.py GRPC_HOST:PORT HTTP_HOST:PORT CA.pem C OUT.json
Prints nothing on success; writes what it saw as JSON for the test to assert on.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def infer(module, client, width):
    x = np.ones((1, 4, width), np.float32)
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer("mha", [tensor]).as_numpy("y").shape


def main():
    grpc_url, http_url, ca, width, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    seen = {}
    with grpcclient.InferenceServerClient(grpc_url, ssl=True, root_certificates=ca) as client:
        seen["grpc_ready"] = client.is_server_ready()
        seen["grpc_shape"] = list(infer(grpcclient, client, width))
    client = httpclient.InferenceServerClient(http_url, ssl=True, ssl_options={"ca_certs": ca})
    seen["http_ready"] = client.is_server_ready()
    seen["http_shape"] = list(infer(httpclient, client, width))
    client.close()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
