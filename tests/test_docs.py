"""The documentation's commands work as written against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from tests.support import ROOT, ServerThread, make_settings, server_process


def _grpcurl_calls() -> list[list[str]]:
    """Run the API page's grpcurl block in bash, with grpcurl recording its arguments."""
    text = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"With grpcurl.*?```sh\n(.*?)```", text, re.S)
    assert block, "docs/api.md lost its grpcurl example"
    script = "grpcurl() { printf '%s\\x1f' \"$@\"; printf '\\x1e'; }\n" + block.group(1)
    out = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, check=True, timeout=60).stdout
    return [call.split("\x1f")[:-1] for call in out.split("\x1e")[:-1]]


def test_the_grpcurl_examples_run_against_the_default_model(default_model_dir: Path) -> None:
    calls = _grpcurl_calls()
    assert len(calls) == 4
    settings = make_settings(default_model_dir, backend="torch")
    with ServerThread(settings) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for args in calls:
            if "-d" not in args:
                continue  # `list`: reflection, tested with the server
            body, method = args[args.index("-d") + 1], args[-1]
            service, name = method.rsplit("/", 1)
            if service == "grpc.health.v1.Health":
                request = json_format.Parse(body, health_pb2.HealthCheckRequest())
                assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status == 1  # SERVING
                continue
            request_type = {"ModelMetadata": pb.ModelMetadataRequest, "ModelInfer": pb.ModelInferRequest}[name]
            response = getattr(stub, name)(json_format.Parse(body, request_type()), timeout=10)
            if name == "ModelInfer":
                assert list(response.outputs[0].shape) == [1, 1, 128]


def test_the_readme_client_commands_run_as_written(default_model_dir: Path, tmp_path: Path) -> None:
    """`.venv/bin/mha` is where the README says, and its infer and verify lines work against a
    server of the default model (at the port the test got instead of 8001)."""
    block = re.search(r"## Use it\n\n(?:<!-- .*? -->\n)?```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README lost its `Use it` commands"
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    clients = [line for line in lines if line.startswith((".venv/bin/mha infer", ".venv/bin/mha verify"))]
    assert len(clients) == 2 and (ROOT / ".venv" / "bin" / "mha").exists()
    models = tmp_path / "models"
    models.mkdir()
    (models / "default").symlink_to(default_model_dir)
    with server_process(["--model-dir", str(default_model_dir)], tmp_path / "server.log") as server:
        for line in clients:
            command = line.replace(".venv/bin/mha", str(ROOT / ".venv" / "bin" / "mha"), 1)
            command = command.replace("127.0.0.1:8001", server.url)  # models/default: the link in cwd
            command = command.replace("127.0.0.1:8000", f"127.0.0.1:{server.http_port}")
            run = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, (command, run.stderr[-2000:])
            assert "verify" not in command or run.stdout.count(" ok ") == 8, run.stdout  # each route the defaults offer
    assert (tmp_path / "y.npy").is_file()


def test_the_ready_lines_command_runs_as_written(small_model_dir: Path, tmp_path: Path) -> None:
    """The `try ...` a worker of `--workers 2` prints, with a token required, runs from another
    directory with no virtual environment active (the log's JSON escapes nothing it holds)."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = [
        "--model-dir",
        str(small_model_dir),
        "--backend",
        "torch",
        "--workers",
        "2",
        "--auth-token-file",
        str(token),
    ]
    with server_process(args, tmp_path / "server.log") as server:
        for _ in range(600):  # the workers' ready lines may follow the first serving one
            tries = re.findall(r"try `([^`]+)`", server.log())
            if len(tries) >= 2:
                break
            time.sleep(0.1)
        assert len(tries) >= 2, server.log()[-2000:]
        command = tries[0].replace("--url", "--shape 1,4,32 --url")  # the small model's C
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        run = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (command, run.stderr[-2000:])
