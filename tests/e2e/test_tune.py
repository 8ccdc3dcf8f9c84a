"""`mha tune` on a small model with a budget of seconds: it writes its files, the settings it
chooses serve a server that `mha verify --url` passes, the p99 it reports is one it measured, an
impossible target exits 1 naming the closest candidate, bad input exits 2 before anything starts,
and nothing is left running. The Helm chart and the kustomize base read its config.env as it is."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT, ServerProcess, until

MHA = str(Path(sys.executable).parent / "mha")
FAST = ["--concurrency", "1,2", "--seconds", "0.3", "--rounds", "3"]


def _command(model_dir: Path, out: Path, *args: str, budget_s: float = 30) -> list[str]:
    command = [MHA, "tune", "--model-dir", str(model_dir), "--shape", "1,16,32", "--out", str(out), *FAST]
    return [*command, "--budget-s", str(budget_s), *args]


def _tune(model_dir: Path, out: Path, *args: str, budget_s: float = 30, timeout: float = 240) -> Any:
    command = _command(model_dir, out, *args, budget_s=budget_s)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _started_tune(model_dir: Path, out: Path, *args: str) -> subprocess.Popen[str]:
    """`_tune`, started: the refusals run side by side."""
    return subprocess.Popen(_command(model_dir, out, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _servers_of(model_dir: Path) -> dict[int, str]:
    """Processes whose command line names `model_dir` (pid: command line): the servers a tune
    started and left."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "serve" in cmdline and str(model_dir) in cmdline:
                found[int(proc.name)] = cmdline
    return found


@pytest.fixture(autouse=True)
def _no_server_left_to_later_tests(small_model_dir: Path) -> Iterator[None]:
    """A test here that goes red may leave a tune's servers running: killed after it, so that they
    hold no ports, memory or CPU in the tests that follow (its own asserts say whether any was left)."""
    yield
    for pid in _servers_of(small_model_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


@pytest.fixture(scope="module")
def tuned(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("tune")
    # A candidate takes about 6 s on 2 idle CPUs (a server started, its points measured): this budget
    # measures 11 there (83 s with the confirmation), and 2 or more beside the rest of the suite, a busy
    # loop on one of the 2 CPUs included; the search uses all it is given
    run = _tune(small_model_dir, out, "--p99-ms", "2000", budget_s=90)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return out, run


def test_tune_writes_its_files_and_reports_a_p99_it_measured(tuned: tuple[Path, Any], small_model_dir: Path) -> None:
    out, run = tuned
    for name in ("config.env", "candidates.json", "candidates.md", "pareto.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "candidates.json").read_text())
    chosen = summary["chosen"]
    measured = [row for row in summary["candidates"] if row["settings"] == chosen["settings"]]
    assert len(measured) == 1 and chosen["best"] in measured[0]["points"]  # reported = measured
    assert chosen["best"]["p99_ms"] <= 2000 and summary["meets_target"]
    assert len(summary["candidates"]) >= 2, "it searched beyond the defaults"
    said = f"p99 {chosen['best']['p99_ms']:.2f} ms"
    assert said in run.stdout and "chosen:" in run.stdout
    if summary["confirmation"] is not None:
        assert len(summary["confirmation"]["rounds"]) >= 3 and "interleaved rounds" in run.stdout
    assert "best so far" in run.stderr  # the progress: the current candidate and the best so far
    assert _servers_of(small_model_dir) == {}


def test_the_chosen_settings_serve_what_mha_verify_passes(tuned: tuple[Path, Any], small_model_dir: Path) -> None:
    out, _ = tuned
    settings = _env_file(out / "config.env")
    assert set(settings) >= {"MHA_BACKEND", "MHA_WORKERS", "MHA_MAX_BATCH_SIZE", "MHA_MAX_QUEUE_DELAY_MS"}
    server = ServerProcess(["--model-dir", str(small_model_dir)], env=settings, workers=None)  # the file's
    server.start(out / "verify-server.log")
    try:
        verify = subprocess.run(
            [MHA, "verify", str(small_model_dir), "--url", server.url], capture_output=True, text=True, timeout=300
        )
    finally:
        server.kill()
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]


def test_an_impossible_target_exits_1_and_names_the_closest(small_model_dir: Path, tmp_path: Path) -> None:
    run = _tune(small_model_dir, tmp_path, "--p99-ms", "0.0001", budget_s=2)  # the defaults only: 4 x 0.3 s
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "no candidate meets p99 <= 0.0001 ms; the closest: auto, auto workers" in run.stdout
    assert json.loads((tmp_path / "candidates.json").read_text())["meets_target"] is False
    assert _servers_of(small_model_dir) == {}


def test_a_tune_killed_outright_leaves_no_server_behind(small_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, kill -9, a CI job's timeout) gives tune no chance to stop its
    servers: before, each candidate's server went on holding its ports and memory."""
    command = _command(small_model_dir, tmp_path / "o", "--p99-ms", "2000", budget_s=120)
    tune = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # a server that listens has tied itself to the tune (killed before, it would find it gone and exit)
        until(lambda: _listening(small_model_dir), timeout_s=120, every_s=0.2, what="a candidate server listening")
    finally:
        tune.kill()
        tune.wait(10)
    until(lambda: not _servers_of(small_model_dir), timeout_s=60, every_s=0.2, what="no server of the tune is left")


def _listening(model_dir: Path) -> bool:
    """A server of `model_dir` accepts connections on its --grpc-port."""
    for cmdline in _servers_of(model_dir).values():
        words = cmdline.split()
        if "--grpc-port" in words:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", int(words[words.index("--grpc-port") + 1]))) == 0:
                    return True
    return False


def _bad_dir(tmp_path: Path, small_model_dir: Path) -> Path:
    """A copy of the model whose weights no longer match its manifest."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in small_model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"]["sha256"] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


def test_bad_input_exits_2_with_a_clear_message_and_starts_nothing(small_model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        (a_file := tmp_path / "a-file").write_text("")
        cases = {
            "impossible target": (small_model_dir, ["--p99-ms", "0"], "impossible"),
            "no target at all": (small_model_dir, ["--p99-ms", "inf"], "impossible"),
            "seconds that are not a number": (small_model_dir, ["--p99-ms", "5", "--seconds", "nan"], "finite"),
            "a shape the model cannot serve": (small_model_dir, ["--p99-ms", "5", "--shape", "1,16,64"], "C = 32"),
            "a sequence too long": (small_model_dir, ["--p99-ms", "5", "--shape", "1,65,32"], "T <= 64"),
            "a port in use": (small_model_dir, ["--p99-ms", "5", "--grpc-port", port], "in use"),
            "a model that fails its checks": (_bad_dir(tmp_path, small_model_dir), ["--p99-ms", "5"], "fails its"),
            "no model": (tmp_path / "nowhere", ["--p99-ms", "5"], "no exported model"),
            "an --out that is a file": (small_model_dir, ["--p99-ms", "5", "--out", str(a_file)], "cannot write"),
            "a budget the defaults alone overrun": (  # before: --budget-s 10 ran 80 s and more
                small_model_dir,
                ["--p99-ms", "5", "--seconds", "20", "--budget-s", "10"],
                "--budget-s 10: measuring even the defaults takes at least 80 s",
            ),
        }
        runs = {case: _started_tune(model_dir, tmp_path / "out", *args) for case, (model_dir, args, _) in cases.items()}
        for case, run in runs.items():
            _, stderr = run.communicate(timeout=60)
            assert run.returncode == 2, f"{case}: {run.returncode} {stderr[-500:]}"
            assert cases[case][2] in stderr, f"{case}: {stderr[-500:]}"
    assert not (tmp_path / "out" / "config.env").exists()
    assert _servers_of(small_model_dir) == {}


def test_helm_and_kustomize_read_config_env_unchanged(tuned: tuple[Path, Any], tmp_path: Path) -> None:
    from helm_python import chart as helm

    out, _ = tuned
    text = (out / "config.env").read_text()
    settings = _env_file(out / "config.env")
    rendered = helm.Chart.load(ROOT / "deploy" / "helm" / "mha-serve").render(
        {"tuned": text}, name="mha-serve", namespace="serving", is_install=True
    )
    docs = [d for path, t in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "mha-serve-config"]
    assert {k: config["data"][k] for k in settings} == settings
    overlay = tmp_path / "tuned"
    overlay.mkdir()
    (overlay / "config.env").write_text(text)
    base = os.path.relpath(ROOT / "deploy" / "k8s" / "overlays" / "cpu", overlay)
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{base}]\nconfigMapGenerator:\n  - name: mha-serve-config\n    behavior: merge\n"
        "    envs: [config.env]\n"
    )
    kubectl = Path(sys.executable).parent / "kubectl"
    run = subprocess.run([str(kubectl), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    maps = [d for d in yaml.safe_load_all(run.stdout) if d and d["kind"] == "ConfigMap"]
    (merged,) = [d for d in maps if d["metadata"]["name"].startswith("mha-serve-config")]
    assert {k: merged["data"][k] for k in settings} == settings
