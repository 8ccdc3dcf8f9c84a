"""HTTP/REST requests of one client on one keep-alive connection, this checkout against another
revision, side by side in one run.

One `mha serve --workers 1` per revision (this checkout, and the code at --base REV from a
temporary worktree), both started at once, both on the backend --backend names. Each run visits
them in turn (the order reversed every other run) and keeps the p50 of `--count` (1, 64, 128)
requests (`--shape`, (1, 64, 128) by default) sent with Triton's binary-data extension and of
`--count` / 4 sent as JSON. Reported:
the medians over the runs of this checkout's p50 over the base's, and every run's ratio. Writes
bench/results/http_body.json. Not a test.

usage: python bench/http_body.py --base REV [--runs 10] [--count 400] [--shape 1,64,128] [--model-dir DIR]
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np
from compare import checkout

from service.app.launch import free_ports

log = logging.getLogger("bench")
ROOT = Path(__file__).resolve().parent.parent


def start(tree: Path, model_dir: Path, backend: str) -> tuple[subprocess.Popen[bytes], int]:
    grpc_port, http_port = free_ports(2)
    flags = ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", "off"]
    command = [sys.executable, "-m", "service.cli", "serve", "--model-dir", str(model_dir.resolve()), *flags]
    command += ["--workers", "1", "--backend", backend]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, http_port


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def bodies(shape: tuple[int, ...]) -> dict[str, tuple[bytes, dict[str, str]]]:
    """The same input of `shape` as binary data and as JSON."""
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
    binary_out = [{"name": "y", "parameters": {"binary_data": True}}]
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}], "outputs": binary_out})
    listed = json.dumps({"inputs": [{**tensor, "data": x.ravel().tolist()}]})
    return {
        "binary": (head.encode() + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))}),
        "json": (listed.encode(), {}),
    }


def p50_ms(port: int, body: bytes, headers: dict[str, str], count: int) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    seen = []
    for _ in range(count):
        start_s = time.perf_counter()
        connection.request("POST", "/v2/models/mha/infer", body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}")
        seen.append(time.perf_counter() - start_s)
    connection.close()
    return statistics.median(seen) * 1e3


def wait_answering(port: int, proc: subprocess.Popen[bytes], body: tuple[bytes, dict[str, str]]) -> None:
    deadline = time.monotonic() + 180
    while True:
        with contextlib.suppress(OSError, RuntimeError, http.client.HTTPException):
            p50_ms(port, *body, 1)
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not answer")
        time.sleep(0.5)


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--base", required=True, help="mha-serve at this git revision")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--backend", default="ort-cpu")
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    parser.add_argument("--shape", default="1,64,128", help="B,T,C of the request")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    kinds = bodies(shape)
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds}
    with contextlib.ExitStack() as stack:
        trees = {"this": ROOT, "base": stack.enter_context(checkout(args.base))}
        ports = {}
        for name, tree in trees.items():
            proc, ports[name] = start(tree, args.model_dir, args.backend)
            stack.callback(stop, proc)
            wait_answering(ports[name], proc, kinds["binary"])
        for run in range(args.runs):
            order = list(ports) if run % 2 == 0 else list(reversed(ports))
            for kind, (body, headers) in kinds.items():
                count = args.count if kind == "binary" else max(1, args.count // 4)
                p50 = {name: p50_ms(ports[name], body, headers, count) for name in order}
                ratios[kind].append(p50["this"] / p50["base"])
                log.info("run %d %s: %s", run + 1, kind, {n: round(v, 3) for n, v in p50.items()})
    summary = {
        "base": args.base,
        "backend": args.backend,
        "shape": list(shape),
        "this_over_base_p50": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
        "runs": {k: [round(r, 3) for r in v] for k, v in ratios.items()},
    }
    common.write_json("http_body.json", summary)
    log.info("%s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
