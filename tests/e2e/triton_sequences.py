"""Runs under .venv-triton: tritonclient drives 8 concurrent sequences through a running
mha-serve, step by step (t = 1 and t > 1), over streams and unary calls, with a restart.

usage: triton_sequences.py HOST:PORT OUT.json
Writes every step's input and output; the test checks them against the float64 reference.
"""

import json
import queue
import sys
import threading

import numpy as np
import tritonclient.grpc as grpcclient


def step_input(x):
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


def run_sequence(url, index, C, out):
    """One sequence: a prefix, then single tokens and short chunks; odd ones restart half-way."""
    rng = np.random.default_rng(100 + index)
    sequence_id = 1000 + index if index % 2 else f"conversation-{index}"
    chunks = [int(rng.integers(1, 8))] + [1 if rng.random() < 0.7 else int(rng.integers(2, 5)) for _ in range(15)]
    B = 1 + index % 2
    client = grpcclient.InferenceServerClient(url)
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    steps = []
    held = 0  # tokens the server holds, as docs/api.md says to track them
    try:
        for i, t in enumerate(chunks):
            restart = index % 2 == 1 and i == 8
            x = rng.standard_normal((B, t, C), dtype=np.float32)
            start, end = i == 0 or restart, i == len(chunks) - 1
            held = 0 if start else held
            if i % 5 == 4:  # some steps as unary calls, between the stream's, as docs/api.md writes them
                result = client.infer(
                    MODEL,
                    step_input(x),
                    sequence_id=sequence_id,
                    sequence_start=start,
                    sequence_end=end,
                    headers={"mha-sequence-id": str(sequence_id)},
                    parameters={"sequence_offset": held},
                )
            else:
                client.async_stream_infer(
                    MODEL, step_input(x), sequence_id=sequence_id, sequence_start=start, sequence_end=end
                )
                result, error = answers.get(timeout=60)
                if error is not None:
                    raise RuntimeError(str(error))
            length = result.get_response().parameters["sequence_length"].int64_param
            held += t
            steps.append({"x": x.tolist(), "y": result.as_numpy("y").tolist(), "start": start, "length": length})
    finally:
        client.stop_stream()
    try:  # the sequence ended with its last step: one more step is refused
        client.infer(MODEL, step_input(np.zeros((B, 1, C), np.float32)), sequence_id=sequence_id)
        after_end = None
    except grpcclient.InferenceServerException as exc:
        after_end = {"status": exc.status(), "message": exc.message()}
    out[index] = {"id": str(sequence_id), "steps": steps, "after_end": after_end}


url, out_path = sys.argv[1:3]
MODEL = "mha_sequence"  # the sequence model: its config has sequence_batching, as a Triton tool reads it
meta = grpcclient.InferenceServerClient(url).get_model_metadata("mha", as_json=True)
C = int(meta["inputs"][0]["shape"][-1])
config = grpcclient.InferenceServerClient(url).get_model_config(MODEL, as_json=True)
results = {}
threads = [threading.Thread(target=run_sequence, args=(url, i, C, results)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(300)
with open(out_path, "w") as f:
    json.dump({"config": config, "sequences": [results.get(i) for i in range(8)]}, f)
