"""What a server's memory does across model updates: resident memory (VmRSS) of `mha serve
--model-repository ... --model-control-mode explicit` after each of `--updates` load calls, each
version replacing the last (no live sequences: the old one unloads at once), with requests served
between them. A version that leaked would add its size at every update. Writes
bench/results/model_updates.json. Not a test.

usage: python bench/model_updates.py [--updates 6]
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import common
import grpc
import numpy as np

from export.pipeline import export_model_dir
from model import MHAConfig
from model.checkpoint import init_weights
from service.app.launch import ServerProcess
from service.client.client import MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger("bench")


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--updates", type=int, default=6)
    args = parser.parse_args()
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    root, config = Path(tempfile.mkdtemp(prefix="mha-updates-")), MHAConfig()
    for version in range(1, args.updates + 2):  # exported first: the server's memory is measured alone
        export_model_dir(root / "staging" / str(version), config, init_weights(config, seed=version))
    (root / "repo" / "mha").mkdir(parents=True)
    (root / "staging" / "1").rename(root / "repo" / "mha" / "1")
    flags = ["--model-repository", str(root / "repo"), "--model-control-mode", "explicit", "--load-model", "mha"]
    server = ServerProcess([*flags, "--backend", "ort-cpu"])
    server.start(root / "server.log")
    rows = []
    try:
        with MHAClient(server.url) as client, grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            x = np.random.default_rng(0).standard_normal((4, 256, config.d_model), dtype=np.float32)
            for version in range(1, args.updates + 2):
                if version > 1:
                    (root / "staging" / str(version)).rename(root / "repo" / "mha" / str(version))
                    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mha"), timeout=300)
                for _ in range(20):
                    client.infer(x)
                time.sleep(1.5)
                assert server.proc is not None
                rows.append({"version": version, "rss_mib": round(common.rss_mib(server.proc.pid), 1)})
                log.info("version %d serving: RSS %.1f MiB", version, rows[-1]["rss_mib"])
    finally:
        server.terminate()
    common.write_json("model_updates.json", {"model": "default (C=128)", "backend": "ort-cpu", "rows": rows})


if __name__ == "__main__":
    main()
