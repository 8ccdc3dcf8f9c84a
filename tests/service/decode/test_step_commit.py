"""A decode step commits to its sequence only when its answer is delivered: a step whose client
left while its batch was computing leaves the sequence as it was, and the client's retry with the
offset it knew is accepted and exact."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.client.client import MHAClient
from service.protocol.grpc_codec import encode_infer_request
from service.protocol.inference import SEQUENCE_HEADER, SEQUENCE_LENGTH, SEQUENCE_OFFSET
from tests.support import ComputeGate, ServerThread, make_settings, until


def _step_future(client: MHAClient, sequence_id: str, x: np.ndarray, offset: int) -> grpc.Future:
    request = encode_infer_request(x)
    request.parameters["sequence_id"].string_param = sequence_id
    request.parameters[SEQUENCE_OFFSET].int64_param = offset
    return client.stub.ModelInfer.future(request, timeout=60, metadata=((SEQUENCE_HEADER, sequence_id),))


def test_a_step_cancelled_while_its_batch_computes_commits_nothing(small_model_dir: Path) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    tokens = {s: np.random.default_rng(i).standard_normal((1, 4, 32), dtype=np.float32) for i, s in enumerate("abc")}
    gate = ComputeGate(held=())
    settings = make_settings(small_model_dir, backend="torch", max_step_rows=8)
    with ServerThread(settings, compute_hook=gate) as server, MHAClient(server.url) as client:
        for s in "abc":  # two tokens of each sequence held by the server
            assert client.step(s, tokens[s][:, :2], 0, start=True).length == 2
        gate.held = ("steps",)
        blocker = _step_future(client, "c", tokens["c"][:, 2:3], 2)
        gate.arrived()  # c's step computes (held): a's and b's steps queue behind it, and share a batch
        a, b = (_step_future(client, s, tokens[s][:, 2:3], 2) for s in "ab")
        until(lambda: server.engine.requests.count == 3, every_s=0.002, what="a's and b's steps are queued")
        gate.permits.release()
        gate.arrived()  # the batch of a's and b's steps is computing
        assert gate.computed[-1] == ("steps", 1), gate.computed  # c's, let through
        b.cancel()  # b's client leaves while its step computes
        until(
            lambda: server.engine.requests.count == 1,
            every_s=0.002,
            what="the server saw b's cancellation (a's step alone in flight)",
        )
        gate.held = ()
        gate.permits.release()
        assert blocker.result().parameters[SEQUENCE_LENGTH].int64_param == 3
        assert a.result().parameters[SEQUENCE_LENGTH].int64_param == 3
        assert gate.computed[-1] == ("steps", 2), gate.computed  # a's and b's steps, computed together
        retried = client.step("b", tokens["b"][:, 2:4], 2)  # the offset b's client knew: nothing was added
        assert retried.length == 4
        reference = attention_view(torch.from_numpy(tokens["b"]), weights, config)[:, 2:4]
        assert relative_error(torch.from_numpy(retried.y.copy()), reference) < 1e-5
