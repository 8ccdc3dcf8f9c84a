"""The floors of the comparison: the cheapest Python gRPC servers of the same protocol.

`none` answers each ModelInfer with its own input (the protocol and the copies, no compute);
`ort` runs ONNX Runtime in-line on the event loop (the compute with nothing around it: no
batching, no checks, no metrics), with ORT's defaults as KServe keeps them; `served` does the
same with the cheapest compute known here: the graph as mha-serve's ORT-CPU serves it
(export/serving_graph.py) on one intra-op thread that sleeps when idle. The `served` floor is the
cheapest server of this gRPC stack that computes the model. Run by bench/compare.py in the main
virtual environment.

With PROCESSES above 1 (what compare.py passes: as many as mha-serve's --workers start), that
many independent processes share the port by SO_REUSEPORT, as mha-serve's workers do: the
floor for a server of that many processes. Each client connection reaches one of them.

usage: python bench/servers/floor.py none|ort|served PORT MODEL_DIR [PROCESSES]
(BENCH_ORT_THREADS sizes ORT's pool where compare.py pins the servers: see kserve_ort.py)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort

from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc


class Floor(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, session: ort.InferenceSession | None) -> None:
        self.session = session

    async def ServerReady(self, request: pb.ServerReadyRequest, context: object) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: object) -> pb.ModelInferResponse:
        shape = list(request.inputs[0].shape)
        raw = request.raw_input_contents[0]
        if self.session is not None:
            x = np.frombuffer(raw, np.float32).reshape(shape)  # (B, T, C)
            raw = self.session.run(None, {"x": x})[0].tobytes()
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="y", datatype="FP32", shape=shape)
        response.raw_output_contents.append(raw)
        return response


def session(mode: str, model_dir: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ.get("BENCH_ORT_THREADS", "0"))  # 0: ORT's default
    path = str(model_dir / "model.onnx")
    if mode != "served":
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])  # as exported: rewritten


async def serve(mode: str, port: int, model_dir: Path, shared: bool) -> None:
    computes = session(mode, model_dir) if mode != "none" else None
    server_options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 1 if shared else 0)]
    server = grpc.aio.server(options=server_options)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(computes), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str]) -> None:
    mode, port, model_dir = argv[0], int(argv[1]), Path(argv[2])
    processes = int(argv[3]) if len(argv) > 3 else 1
    others = [subprocess.Popen([sys.executable, __file__, *argv[:3], "1", "shared"]) for _ in range(processes - 1)]
    try:
        asyncio.run(serve(mode, port, model_dir, shared=processes > 1 or argv[4:] == ["shared"]))
    finally:
        for other in others:
            other.terminate()


if __name__ == "__main__":
    main(sys.argv[1:])
