"""Triton's schedule policy as a client and an operator meet it: set by flags or by the repository's
config.pbtxt, shown in ModelConfig under Triton's field names (gRPC and HTTP), and applied to
the `priority` a request sends."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from export.pipeline import export_model_dir
from model import MHAConfig
from model.checkpoint import init_weights
from service.client.client import MHAClient
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request
from tests.support import ServerThread, http_json, make_settings

SMALL = MHAConfig(d_model=32, n_head=4, max_seq_len=64)


def _infer(port: int, priority: int) -> tuple[int, dict]:
    tensor = {"name": "x", "shape": [1, 3, 32], "datatype": "FP32", "data": [0.5] * 96}
    return http_json(port, "/v2/models/mha/infer", {"inputs": [tensor], "parameters": {"priority": priority}})


def test_flags_set_the_levels_and_model_config_says_them_on_both_protocols(small_model_dir: Path) -> None:
    settings = make_settings(
        small_model_dir,
        backend="torch",
        http_port=0,
        priority_levels=3,
        default_priority_level=2,
        queue_policy="timeout_action=DELAY,default_timeout_microseconds=5000;1:max_queue_size=8",
    )
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        batching = client.model_config().dynamic_batching
        assert (batching.priority_levels, batching.default_priority_level) == (3, 2)
        assert batching.default_queue_policy.timeout_action == pb.ModelQueuePolicy.DELAY
        assert batching.default_queue_policy.default_timeout_microseconds == 5000
        assert batching.priority_queue_policy[1].max_queue_size == 8
        assert batching.priority_queue_policy[1].timeout_action == pb.ModelQueuePolicy.REJECT
        _, config = http_json(server.http_port, "/v2/models/mha/config")
        assert config["dynamic_batching"]["priority_levels"] == 3
        assert config["dynamic_batching"]["default_queue_policy"]["timeout_action"] == "DELAY"
        for priority in (0, 1, 3):
            assert _infer(server.http_port, priority)[0] == 200
        code, answer = _infer(server.http_port, 4)
        assert code == 400 and "priority levels 1..3" in answer["error"]
        request = encode_infer_request(np.ones((1, 2, 32), np.float32), "mha", "", "")
        request.parameters["priority"].uint64_param = 3  # as tritonclient sends it
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert decode_infer_response(stub.ModelInfer(request, timeout=30)).shape == (1, 2, 32)
            request.parameters["priority"].uint64_param = 9
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


CONFIG_PBTXT = """
name: "mha"
dynamic_batching {
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 100000 }
  priority_queue_policy { key: 1 value { max_queue_size: 4 allow_timeout_override: true } }
}
"""


def test_the_repositorys_config_pbtxt_sets_them_as_in_triton(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    export_model_dir(repo / "mha" / "1", SMALL, init_weights(SMALL, seed=3))
    (repo / "mha" / "config.pbtxt").write_text(CONFIG_PBTXT)
    settings = replace(make_settings(tmp_path), model_dir=None, model_repository=repo, backend="torch", http_port=0)
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        batching = client.model_config().dynamic_batching
        assert (batching.priority_levels, batching.default_priority_level) == (2, 2)
        assert batching.default_queue_policy.default_timeout_microseconds == 100000
        assert batching.priority_queue_policy[1].max_queue_size == 4
        assert _infer(server.http_port, 2)[0] == 200
        assert _infer(server.http_port, 3)[0] == 400


def test_a_config_pbtxt_whose_levels_do_not_hold_together_stops_the_start(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    export_model_dir(repo / "mha" / "1", SMALL, init_weights(SMALL, seed=3))
    (repo / "mha" / "config.pbtxt").write_text("dynamic_batching { priority_levels: 2 default_priority_level: 5 }")
    settings = replace(make_settings(tmp_path), model_dir=None, model_repository=repo, backend="torch")
    says = r"config.pbtxt: dynamic_batching: default_priority_level 5 is outside"
    with pytest.raises(Exception, match=says), ServerThread(settings):
        pass


def test_max_batch_size_bounds_requests_and_batches_as_in_triton(small_model_dir: Path) -> None:
    """The config's max_batch_size is the largest B a request may carry and the largest batch
    executed: the batcher never merges past it, whatever --max-batch-size asks."""
    settings = make_settings(small_model_dir, backend="torch", max_batch_size=16, max_request_rows=4)
    with ServerThread(settings) as server, MHAClient(server.url) as client:
        config = client.model_config()
        assert config.max_batch_size == 4 and list(config.dynamic_batching.preferred_batch_size) == [4]
        assert server.engine.loaded.batcher.config.max_batch_size == 4
        assert client.infer(np.ones((4, 2, 32), np.float32)).shape == (4, 2, 32)
        with pytest.raises(Exception, match="exceeds this server's limit of 4 rows"):
            client.infer(np.ones((5, 2, 32), np.float32))
