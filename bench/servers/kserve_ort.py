"""KServe's ModelServer with the same ONNX file on ONNX Runtime (CPU), as a KServe user would
write it. Runs in its own virtual environment (`make bench-servers`), started by bench/compare.py.

usage: KSERVE_GRPC_PORT=P KSERVE_HTTP_PORT=Q python bench/servers/kserve_ort.py MODEL_DIR

BENCH_ORT_THREADS=N (set by compare.py when it pins the servers to N CPUs) sizes ORT's pool, as
one would for a pod of N CPUs: ORT's default pool pins a thread to every core of the machine,
outside the CPUs the server was given.
"""

from __future__ import annotations

import os
import sys

import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class MHA(Model):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ.get("BENCH_ORT_THREADS", "0"))  # 0: ORT's default
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.ready = True

    async def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
        y = self.session.run(None, {"x": payload.inputs[0].as_numpy()})[0]
        output = InferOutput(name="y", shape=list(y.shape), datatype="FP32")
        output.set_data_from_numpy(y, binary_data=True)
        return InferResponse(model_name=self.name, infer_outputs=[output], response_id=payload.id)


if __name__ == "__main__":
    model = MHA("mha", os.path.join(sys.argv[1], "model.onnx"))
    server = ModelServer(
        grpc_port=int(os.environ["KSERVE_GRPC_PORT"]),
        http_port=int(os.environ["KSERVE_HTTP_PORT"]),
        workers=1,
        enable_latency_logging=False,
    )
    server.start([model])
