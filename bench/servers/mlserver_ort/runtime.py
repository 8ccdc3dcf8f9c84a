"""MLServer's custom runtime for the same ONNX file on ONNX Runtime (CPU), as an MLServer user
would write it. bench/compare.py writes the settings beside a copy of this file and starts
`mlserver start` in its own virtual environment (`make bench-servers`). BENCH_ORT_THREADS sizes
ORT's pool where compare.py pins the servers (see kserve_ort.py)."""

from __future__ import annotations

import os

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class MHARuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(os.environ.get("BENCH_ORT_THREADS", "0"))  # 0: ORT's default
        self.session = ort.InferenceSession(self.settings.parameters.uri, options, providers=["CPUExecutionProvider"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        y = self.session.run(None, {"x": x})[0]
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=[NumpyCodec.encode_output("y", y)])
