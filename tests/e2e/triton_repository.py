"""Runs under .venv-triton (tritonclient from PyPI): Triton's repository calls against a running
mha-serve, as a Triton user makes them.

usage: triton_repository.py grpc|http HOST:PORT load|unload|index OUT.json
Writes the index after the call, readiness per version and the error, if any, as JSON.
"""

import json
import sys

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def main() -> None:
    protocol, url, action, out = sys.argv[1:5]
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(url)
    error = None
    try:
        if action == "load":
            client.load_model("mha")
        elif action == "unload":
            client.unload_model("mha")
    except module.InferenceServerException as exc:
        error = {"status": str(exc.status()), "message": exc.message()}
    index = client.get_model_repository_index()
    if protocol == "grpc":
        index = [{"name": m.name, "version": m.version, "state": m.state} for m in index.models]
    ready = {v: client.is_model_ready("mha", v) for v in ("1", "2", "3")}
    with open(out, "w") as f:
        json.dump({"error": error, "index": index, "ready": ready}, f)


if __name__ == "__main__":
    main()
