"""Runs under .venv-triton (tritonclient from PyPI): drives a running mha-serve like Triton's users do.

usage: triton_check.py grpc|http HOST:PORT OUT.json
Prints nothing on success; writes what it saw as JSON for the test to assert on.
"""

import json
import os
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm


def unknown_model_ready(client):
    try:
        return client.is_model_ready("bert")
    except (grpcclient.InferenceServerException, httpclient.InferenceServerException) as exc:
        return exc.status()


def server_facts(client, **json_kw):
    return {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready("mha"),
        "version_ready": client.is_model_ready("mha", "1"),
        "unknown_ready": unknown_model_ready(client),
        "metadata": client.get_model_metadata("mha", **json_kw),
        "config": client.get_model_config("mha", **json_kw),
        "server_metadata": client.get_server_metadata(**json_kw),
    }


def _output_facts(result, module):
    """Where the reply says the output is, and whether it carried the data too."""
    if module is grpcclient:
        output = result.get_output("y")
        region = output.parameters["shared_memory_region"].string_param
        return {"region": region, "data_in_reply": any(result.get_response().raw_output_contents)}
    output = result.get_output("y")
    region = output.get("parameters", {}).get("shared_memory_region")
    binary = output.get("parameters", {}).get("binary_data_size", 0)
    return {"region": region, "data_in_reply": "data" in output or binary > 0}


def shared_memory_round_trip(client, module, C, rng):
    """A (4, 512, C) input and its output through system shared memory, as Triton's users do it."""
    x = rng.standard_normal((4, 512, C), dtype=np.float32)
    tag = f"{module.__name__.split('.')[-1]}_{os.getpid()}"
    regions = {
        name: shm.create_shared_memory_region(name, f"/mha_check_{name}_{tag}", x.nbytes) for name in ("in", "out")
    }
    try:
        shm.set_shared_memory_region(regions["in"], [x])
        client.unregister_system_shared_memory()
        for name in regions:
            client.register_system_shared_memory(name, f"/mha_check_{name}_{tag}", x.nbytes)
        status = client.get_system_shared_memory_status(**({"as_json": True} if module is grpcclient else {}))
        tensor = module.InferInput("x", list(x.shape), "FP32")
        tensor.set_shared_memory("in", x.nbytes)
        output = module.InferRequestedOutput("y")
        output.set_shared_memory("out", x.nbytes)
        result = client.infer("mha", [tensor], outputs=[output])
        y = shm.get_contents_as_numpy(regions["out"], np.float32, list(x.shape))
        seen = {
            "status": status,
            "x": x.tolist(),
            "y": y.tolist(),
            "output": _output_facts(result, module),
        }
        tensor.set_shared_memory("missing", x.nbytes)
        try:
            client.infer("mha", [tensor])
        except module.InferenceServerException as exc:
            seen["missing"] = {"status": exc.status(), "message": exc.message()}
        client.unregister_system_shared_memory()
        seen["after"] = client.get_system_shared_memory_status(**({"as_json": True} if module is grpcclient else {}))
        return seen
    finally:
        for region in regions.values():
            shm.destroy_shared_memory_region(region)


def check_grpc(url):
    client = grpcclient.InferenceServerClient(url=url)
    seen = server_facts(client, as_json=True)
    meta = seen["metadata"]
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

    seen["shm"] = shared_memory_round_trip(client, grpcclient, C, rng)
    return seen


def check_http(url):
    client = httpclient.InferenceServerClient(url=url)
    seen = server_facts(client)
    rng = np.random.default_rng(6)
    C = int(seen["metadata"]["inputs"][0]["shape"][-1])
    unary = []
    cases = [(1, 1, True, True, None), (2, 13, False, False, "gzip"), (3, 64, True, False, "deflate")]
    for i, (B, T, binary_in, binary_out, packed) in enumerate(cases):  # packed: both ways compressed so
        x = rng.standard_normal((B, T, C), dtype=np.float32)
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary_in)
        outputs = [httpclient.InferRequestedOutput("y", binary_data=binary_out)]
        packing = {"request_compression_algorithm": packed, "response_compression_algorithm": packed}
        result = client.infer("mha", [tensor], outputs=outputs, request_id=f"h{i}", **packing)
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

    seen["shm"] = shared_memory_round_trip(client, httpclient, C, rng)
    return seen


protocol, url, out_path = sys.argv[1:4]
seen = check_grpc(url) if protocol == "grpc" else check_http(url)
with open(out_path, "w") as f:
    json.dump(seen, f)
