"""KServe's ModelServer with the same ONNX file on ONNX Runtime (CPU), as a KServe user would
write it. Runs in its own virtual environment (`make bench-servers`), started by bench/compare.py.

usage: KSERVE_GRPC_PORT=P KSERVE_HTTP_PORT=Q python bench/servers/kserve_ort.py MODEL_DIR
"""

from __future__ import annotations

import os
import sys

import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class MHA(Model):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
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
