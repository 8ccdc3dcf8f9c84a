"""Triton's Python backend serving the same ONNX file on ONNX Runtime (CPU), as a Triton user
would write it: the requests of one dynamic batch that share T are concatenated along B and run
once. Started by bench/compare.py inside the `tritonserver` of PyTriton's wheel
(`make bench-servers`).

The backend stub's Python finds the server's virtual environment through PATH (compare.py puts
its bin/ first, as PyTriton does). BENCH_ORT_THREADS=N sizes ORT's pool (0: its default).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        parameters = json.loads(args["model_config"])["parameters"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ.get("BENCH_ORT_THREADS", "0"))
        path = parameters["onnx"]["string_value"]
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests: list) -> list:
        xs = [pb_utils.get_input_tensor_by_name(r, "x").as_numpy() for r in requests]
        ys: list = [None] * len(xs)
        by_t: dict[int, list[int]] = {}
        for i, x in enumerate(xs):
            by_t.setdefault(x.shape[1], []).append(i)
        for members in by_t.values():
            merged = np.concatenate([xs[i] for i in members], axis=0)  # (sum B, T, C)
            y = self.session.run(None, {"x": merged})[0]
            start = 0
            for i in members:
                ys[i] = y[start : start + xs[i].shape[0]]  # (B, T, C)
                start += xs[i].shape[0]
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y)]) for y in ys]
