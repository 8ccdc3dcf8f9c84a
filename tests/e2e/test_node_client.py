"""docs/api.md's Node.js client, run as written (node, @grpc/grpc-js) against a live server: a
client in another language reaches the same exact answers, stateless and step by step."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_einsum
from tests.support import ROOT, ServerThread, make_settings

NODE_MODULES = ROOT / ".tools" / "node" / "node_modules"  # `make` installs them where npm is
MARKER = "<!-- doc-test: elsewhere: test_the_node_client_of_the_docs_answers_exactly -->"
BLOCK = re.compile(re.escape(MARKER) + r"\n```js\n(.*?)```", re.S)

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (NODE_MODULES / "@grpc" / "grpc-js").is_dir(),
    reason="needs node and `make node-client` (npm): the Node.js client's packages",
)


def _client(tmp_path: Path) -> Path:
    found = BLOCK.search((ROOT / "docs" / "api.md").read_text())
    assert found, "docs/api.md lost its Node.js client"
    script = tmp_path / "client.js"
    script.write_text(found.group(1))
    return script


def _run(script: Path, url: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "NODE_PATH": str(NODE_MODULES)}
    node = shutil.which("node")
    assert node is not None
    return subprocess.run([node, str(script), url], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _reference(x: np.ndarray, model_dir: Path) -> np.ndarray:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    with torch.no_grad():
        return attention_einsum(torch.from_numpy(x), weights, config).numpy()


def test_the_node_client_of_the_docs_answers_exactly(default_model_dir: Path, tmp_path: Path) -> None:
    script = _client(tmp_path)
    with ServerThread(make_settings(default_model_dir, backend="ort-cpu")) as server:
        run = _run(script, server.url)
    assert run.returncode == 0, run.stderr[-2000:]
    shape_line, held_line, answers = run.stdout.strip().splitlines()
    assert shape_line == "y 1x12x128 by ort-cpu" and held_line == "step: held 13 tokens"
    got = json.loads(answers)
    x = np.sin(np.arange(12 * 128, dtype=np.float64)).astype(np.float32).reshape(1, 12, 128)  # as the script makes it
    token = np.cos(np.arange(128, dtype=np.float64)).astype(np.float32).reshape(1, 1, 128)
    y = np.asarray(got["y"], dtype=np.float64).reshape(1, 12, 128)
    np.testing.assert_allclose(y, _reference(x, default_model_dir), rtol=0, atol=1e-5)
    whole = np.concatenate([x, token], axis=1)  # (1, 13, 128): the prefix and the step's token
    step = np.asarray(got["step"], dtype=np.float64).reshape(1, 1, 128)
    np.testing.assert_allclose(step, _reference(whole, default_model_dir)[:, -1:], rtol=0, atol=1e-5)


def test_the_node_client_says_why_it_failed(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    run = _run(_client(tmp_path), f"127.0.0.1:{port}")
    assert run.returncode == 1 and run.stderr.startswith("UNAVAILABLE"), run.stderr[-2000:]
