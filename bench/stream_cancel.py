"""Work done for clients who left: tokens computed against tokens delivered when streams are cancelled.

Case 1: one ModelStreamInfer stream of 200 requests (T from 1 to 512, seeded), cancelled by the
client after 40 answers. Case 2: 50 streams of 4 requests (T 256), each dropped after its first
answer, all at once. From the server's own /metrics: tokens computed (mha_tokens_total, counted
as each answer is computed) and the stream requests counted OK and CANCELLED; from the client:
the answers and tokens it received. OK should equal what was delivered.
Writes bench/results/stream_cancel.json. Not a test.

usage: python bench/stream_cancel.py [--model-dir models/default]
"""

from __future__ import annotations

import logging
import threading
import time

import common
import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.app.launch import ServerProcess
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request

log = logging.getLogger("bench")
C = 128


def counters(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {"tokens": 0.0, "OK": 0.0, "CANCELLED": 0.0, "inflight": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mha_tokens_total":
                found["tokens"] += sample.value
            elif sample.name == "mha_requests_total" and sample.labels.get("method") == "ModelStreamInfer":
                code = sample.labels["code"]
                if code in found:
                    found[code] += sample.value
            elif sample.name == "mha_inflight_requests":
                found["inflight"] = sample.value
    return found


def settled(port: int) -> dict[str, float]:
    deadline = time.monotonic() + 60
    while counters(port)["inflight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    return counters(port)


def one_stream(url: str, ts: list[int], keep: int) -> tuple[int, int]:
    """Send one stream of requests of these T, read `keep` answers, cancel: (answers, tokens) read."""
    rng = np.random.default_rng(0)
    requests = (
        encode_infer_request(rng.standard_normal((1, t, C), dtype=np.float32), request_id=str(i))
        for i, t in enumerate(ts)
    )
    got = tokens = 0
    with grpc.insecure_channel(url) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests, timeout=120)
        for response in call:
            got += 1
            tokens += int(np.prod(response.infer_response.outputs[0].shape[:2]))
            if got == keep:
                call.cancel()
                break
    return got, tokens


def measure(server: ServerProcess, run: object) -> dict[str, float]:
    before = settled(server.metrics_port)
    got, tokens = run()  # type: ignore[operator]
    after = settled(server.metrics_port)
    figures = {k: after[k] - before[k] for k in ("tokens", "OK", "CANCELLED")}
    return {
        "answers_delivered": got,
        "tokens_delivered": tokens,
        "tokens_computed": figures["tokens"],
        "counted_ok": figures["OK"],
        "counted_cancelled": figures["CANCELLED"],
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--model-dir", type=common.model_dir, default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    server = ServerProcess(["--model-dir", str(args.model_dir)])
    server.start(common.RESULTS / "stream_cancel.log")
    try:
        ts = [int(t) for t in np.random.default_rng(1).integers(1, 513, 200)]
        long_stream = measure(server, lambda: one_stream(server.url, ts, 40))
        log.info("one stream of 200, cancelled after 40: %s", long_stream)

        def dropped() -> tuple[int, int]:
            results: list[tuple[int, int]] = []
            threads = [
                threading.Thread(target=lambda: results.append(one_stream(server.url, [256] * 4, 1))) for _ in range(50)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return sum(r[0] for r in results), sum(r[1] for r in results)

        many = measure(server, dropped)
        log.info("50 streams of 4, each dropped after its first answer: %s", many)
    finally:
        server.terminate()
    path = common.write_json(
        "stream_cancel.json", {"one_stream_200_cancel_after_40": long_stream, "fifty_streams_of_4_dropped": many}
    )
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
