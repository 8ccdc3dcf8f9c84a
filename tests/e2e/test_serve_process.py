"""`mha serve` as a real process: tritonclient from PyPI, default model, corrupt ONNX, SIGTERM drain."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.typing import ArrayLike
from prometheus_client.parser import text_string_to_metric_families

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.cli import random_input
from service.client.client import InferenceError, MHAClient
from tests.support import ROOT, ServerProcess, server_process

TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"


def _rel(model_dir: Path, x: ArrayLike, y: ArrayLike) -> float:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    ref = attention_view(torch.as_tensor(np.asarray(x, np.float32)), weights, config)
    return relative_error(torch.as_tensor(np.asarray(y, np.float32)), ref)


def _triton_check(model_dir: Path, tmp_path: Path, protocol: str) -> dict:
    """What tritonclient saw of a real `mha serve` process, over gRPC or HTTP."""
    assert TRITON_PYTHON.exists(), "make install creates .venv-triton with tritonclient"
    args = ["--model-dir", str(model_dir), "--shared-memory", "system"]
    with server_process(args, tmp_path / "server.log") as server:
        out = tmp_path / "seen.json"
        url = server.url if protocol == "grpc" else f"127.0.0.1:{server.http_port}"
        script = str(Path(__file__).with_name("triton_check.py"))
        run = subprocess.run(
            [str(TRITON_PYTHON), script, protocol, url, str(out)], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_tritonclient_drives_mha_serve(default_model_dir: Path, tmp_path: Path) -> None:
    seen = _triton_check(default_model_dir, tmp_path, "grpc")
    assert seen["live"] and seen["ready"] and seen["model_ready"] and seen["version_ready"]
    assert seen["unknown_ready"] is False  # as Triton answers
    assert seen["metadata"]["name"] == "mha"
    assert seen["metadata"]["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": ["-1", "-1", "128"]}
    assert seen["config"]["config"]["name"] == "mha"
    assert seen["config"]["config"]["input"][0]["dims"] == ["-1", "128"]
    assert seen["server_metadata"]["name"] == "mha-serve"
    assert [u["id"] for u in seen["unary"]] == ["u1", "u2", "u3"]
    for item in seen["unary"] + seen["stream"]:
        assert "error" not in item, item
        assert _rel(default_model_dir, item["x"], item["y"]) < 1e-5
    assert sorted(s["id"] for s in seen["stream"]) == ["s0", "s1", "s2"]
    assert seen["bad"]["status"] == "StatusCode.INVALID_ARGUMENT" and "expected C = 128" in seen["bad"]["message"]
    _check_shared_memory(seen["shm"], default_model_dir, "StatusCode.NOT_FOUND")


def _check_shared_memory(seen: dict, model_dir: Path, not_found: str) -> None:
    """tritonclient registered two regions, ran (4, 512, 128) through them, and unregistered them."""
    status = seen["status"]
    regions = status["regions"] if isinstance(status, dict) else {r["name"]: r for r in status}
    assert sorted(regions) == ["in", "out"] and int(regions["in"]["byte_size"]) == 4 * 512 * 128 * 4
    assert seen["output"] == {"region": "out", "data_in_reply": False}, "the output went to shared memory only"
    assert _rel(model_dir, seen["x"], seen["y"]) < 1e-5
    assert seen["missing"]["status"] == not_found and "'missing'" in seen["missing"]["message"]
    after = seen["after"]
    assert not (after.get("regions") if isinstance(after, dict) else after)


def test_tritonclient_http_drives_the_rest_endpoint(default_model_dir: Path, tmp_path: Path) -> None:
    seen = _triton_check(default_model_dir, tmp_path, "http")
    assert seen["live"] and seen["ready"] and seen["model_ready"] and seen["version_ready"]
    assert not seen["unknown_ready"]
    assert seen["metadata"]["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, -1, 128]}
    assert seen["config"]["input"][0]["dims"] == [-1, 128] and seen["config"]["parameters"]["verified"]
    assert seen["server_metadata"]["name"] == "mha-serve"
    assert [u["id"] for u in seen["unary"]] == ["h0", "h1", "h2", ""]
    for item in seen["unary"]:
        assert _rel(default_model_dir, item["x"], item["y"]) < 1e-5
    assert seen["stats"]["model_stats"][0]["inference_count"] == 1 + 2 + 3 + 1
    mistakes = seen["mistakes"]
    assert mistakes["C"]["status"] == "400" and "expected C = 128" in mistakes["C"]["message"]
    assert mistakes["T"]["status"] == "400"
    assert mistakes["model"]["status"] == "404" and "unknown model 'bert'" in mistakes["model"]["message"]
    _check_shared_memory(seen["shm"], default_model_dir, "404")


def test_corrupt_onnx_serves_through_torch(default_model_dir: Path, tmp_path: Path) -> None:
    for name in ("weights.safetensors", "manifest.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07garbage" * 1000)
    args = ["--model-dir", str(tmp_path), "--backend", "auto", "--allow-unverified"]
    with server_process(args, tmp_path / "server.log") as server:
        with MHAClient(server.url) as client:
            x = random_input((3, 17, 128), seed=3)
            y = client.infer(x)
            config = client.model_config()
            metadata = client.model_metadata()
        assert _rel(tmp_path, x, y) < 1e-5
        assert config.parameters["backend"].string_value == "torch-cpu"
        assert "ort-cpu: unavailable (failed to load" in config.parameters["selection"].string_value
        assert metadata.platform == "onnxruntime_onnx"  # the model format, stable; the backend says torch
        assert config.parameters["backend_platform"].string_value == "pytorch_libtorch"
        logs = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        assert any("serving" in e["msg"] and "torch-cpu" in e["msg"] for e in logs)
        assert any(e["level"] == "WARNING" and "ort-cpu unavailable" in e["msg"] for e in logs)
        assert any(e["level"] == "ERROR" and "UNVERIFIED" in e["msg"] for e in logs)
        assert config.parameters["verified"].string_value == "false"


def _wait_arrived(server: ServerProcess, count: int, timeout_s: float = 60) -> None:
    """Until the server's own metrics say `count` ModelInfer calls arrived."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        in_flight = families["mha_inflight_requests"].samples[0].value
        answered = sum(s.value for s in families["mha_requests"].samples if s.labels.get("method") == "ModelInfer")
        if in_flight + answered >= count:
            return
        time.sleep(0.005)
    raise AssertionError(f"{count} requests never were in the server together")


def _wait_log(server: ServerProcess, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log():
        assert time.monotonic() < deadline, f"the server never logged {text!r}"
        time.sleep(0.005)


def test_sigterm_drains_in_flight_requests(default_model_dir: Path, tmp_path: Path) -> None:
    """The process: SIGTERM, the late request refused, everything that arrived answered exactly,
    exit 0 within the grace. (Which requests are still computing at the signal depends on the
    machine; tests/service/app/test_server.py holds computes at a gate to drain a known set.)"""
    grace = 15.0
    args = [
        "--model-dir",
        str(default_model_dir),
        "--backend",
        "torch",
        "--grace-s",
        str(grace),
        "--max-batch-size",
        "8",
    ]
    with server_process(args, tmp_path / "server.log") as server:
        results: list[object] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            with MHAClient(server.url) as client:
                x = random_input((8, 512, 128), seed=i)
                try:
                    outcome: object = (x, client.infer(x, timeout=60))  # checked after the drain
                except InferenceError as exc:
                    outcome = exc
            with lock:
                results.append(outcome)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        _wait_arrived(server, 12)  # all in the server; most queued behind each other (12 x ~30 ms of compute)
        signalled = time.monotonic()
        assert server.proc is not None
        server.proc.send_signal(15)
        _wait_log(server, "draining: new requests are refused")
        with MHAClient(server.url) as late, pytest.raises(InferenceError) as info:
            late.infer(np.ones((1, 2, 128), np.float32), timeout=5)
        assert info.value.code.name == "UNAVAILABLE"
        assert "the server is draining for shutdown; retry on another replica" in str(info.value)
        code = server.proc.wait(grace + 10)
        exited_after = time.monotonic() - signalled
        for t in threads:
            t.join(30)
    assert code == 0
    assert exited_after < grace
    assert len(results) == 12
    assert all(isinstance(r, tuple) for r in results), [r for r in results if not isinstance(r, tuple)]
    assert all(_rel(default_model_dir, x, y) < 1e-5 for x, y in results)  # type: ignore[misc]
    assert "draining" in server.log()


def test_tritonclient_decodes_eight_sequences_step_by_step(default_model_dir: Path, tmp_path: Path) -> None:
    """Triton's sequence protocol, as tritonclient speaks it: streams and unary calls, t = 1 and
    t > 1, a restart half-way; every answer is the last rows of the model over the prefix."""
    assert TRITON_PYTHON.exists(), "make install creates .venv-triton with tritonclient"
    with server_process(["--model-dir", str(default_model_dir)], tmp_path / "server.log") as server:
        out = tmp_path / "sequences.json"
        script = str(Path(__file__).with_name("triton_sequences.py"))
        run = subprocess.run(
            [str(TRITON_PYTHON), script, server.url, str(out)], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert "sequence_batching" in seen["config"]["config"]
    config, weights = load_checkpoint(default_model_dir / "weights.safetensors")
    checked = 0
    for sequence in seen["sequences"]:
        assert sequence is not None, "a sequence's thread failed (see the script's stderr)"
        prefix = None
        for step in sequence["steps"]:
            x = np.array(step["x"], np.float32)
            prefix = x if step["start"] else np.concatenate([prefix, x], axis=1)  # (B, P + t, C)
            reference = attention_view(torch.from_numpy(prefix), weights, config)[:, -x.shape[1] :]
            assert relative_error(torch.tensor(step["y"], dtype=torch.float32), reference) < 1e-5
            assert step["length"] == prefix.shape[1]  # sequence_length: the tokens held after the step
            checked += 1
        assert sequence["after_end"]["status"] == "StatusCode.NOT_FOUND", sequence["after_end"]
        assert "ended (sequence_end)" in sequence["after_end"]["message"]
    assert checked == 8 * 16


def test_out_of_file_descriptors_is_said_once_and_the_server_serves_after(
    small_model_dir: Path, tmp_path: Path
) -> None:
    """A flood of idle connections past the open-file limit: asyncio logged every failed accept
    with its traceback (31,000 records, 16 MB, in seconds); now one line says it, and once the
    connections go the server answers as before."""
    import resource
    import socket

    server = ServerProcess(["--model-dir", str(small_model_dir)])
    server.start(tmp_path / "server.log")
    held: list[socket.socket] = []
    try:
        assert server.proc is not None
        resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, (128, 128))
        for _ in range(300):  # more than it may open; the rest wait in the kernel's listen queue
            try:
                held.append(socket.create_connection(("127.0.0.1", server.http_port), timeout=2))
            except OSError:
                break
        deadline = time.monotonic() + 30
        while "cannot accept connections" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        for s in held:
            s.close()
        with MHAClient(server.url) as client:
            x = random_input([1, 4, 32])
            assert client.infer(x, timeout=30).shape == (1, 4, 32)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/ready", timeout=30) as answer:
            assert answer.status == 200
    finally:
        for s in held:
            s.close()
        server.kill()
    said = [line for line in server.log().splitlines() if "accept" in line]
    assert len(said) == 1 and "Too many open files" in said[0], said[:3]
    assert "Traceback" not in server.log()


def test_onnx_runtime_keeps_no_device_id_and_sends_nothing_unless_asked(small_model_dir: Path, tmp_path: Path) -> None:
    """ONNX Runtime's own telemetry (1.29 and later: usage events to its maker, a device id and an
    event database under ~/.cache): off in every `mha` process, workers included, so a served
    model leaves nothing in HOME and every stderr line is the server's own JSON."""
    home = tmp_path / "home"
    home.mkdir()
    server = ServerProcess(
        ["--model-dir", str(small_model_dir), "--backend", "ort-cpu"], env={"HOME": str(home)}, workers="2"
    )
    server.start(tmp_path / "server.log")
    try:
        with MHAClient(server.url) as client:
            assert client.infer(np.ones((1, 4, 32), np.float32)).shape == (1, 4, 32)
    finally:
        server.stop()
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []  # before: .cache/Microsoft/.../deviceid
    for line in server.log().splitlines():
        json.loads(line)  # before, on a read-only HOME: "[W:onnxruntime:Default, telemetry_1ds.cc ...]"
