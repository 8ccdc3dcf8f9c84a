"""`mha infer` and `mha bench` against a real server."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.cli import main as mha
from service.client.loadgen import CONNECTIONS, VARIANTS, input_pool
from service.logs import RequestIdFilter
from tests.support import ServerThread, make_settings, until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as s:
        yield s


def test_infer_from_and_to_npy(
    server: ServerThread, small_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(0).standard_normal((2, 11, 32), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    assert (
        mha(["infer", "--url", server.url, "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")])
        == 0
    )
    out = capsys.readouterr().out
    assert "input [2, 11, 32] -> output [2, 11, 32]" in out and "checksum" in out
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    y = np.load(tmp_path / "y.npy")
    assert relative_error(torch.from_numpy(y), attention_view(torch.from_numpy(x), weights, config)) < 1e-5


def test_bench_checks_its_outputs_first_and_says_when_metrics_are_unreachable(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    started = time.monotonic()
    args = ["bench", "--url", server.url, "--concurrency", "1", "--seconds", "300"]
    assert mha([*args, "--plot", str(tmp_path / "no" / "r.png")]) == 2  # before the 300 s run, not after it
    assert time.monotonic() - started < 60 and f"there is no directory {tmp_path / 'no'}" in caplog.text
    args = ["bench", "--url", server.url, "--concurrency", "1", "--seconds", "0.5", "--metrics-url", "127.0.0.1:1"]
    assert mha(args) == 0
    assert "http://127.0.0.1:1/metrics did not answer (give --metrics-url, or off)" in caplog.text
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "-"  # not measured, and not "None"


def test_infer_says_where_it_wrote_and_checks_the_path_first(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    assert mha(["infer", "--url", server.url, "--shape", "1,4,32", "--output", str(tmp_path / "y")]) == 0
    assert f"wrote the output to {tmp_path / 'y.npy'}" in capsys.readouterr().out
    assert np.load(tmp_path / "y.npy").shape == (1, 4, 32)
    assert mha(["infer", "--url", server.url, "--shape", "1,4,32", "--output", str(tmp_path)]) == 2
    assert "is a directory: name a file" in caplog.text
    assert mha(["infer", "--url", f"http://{server.url}"]) == 2
    assert "expected the gRPC HOST:PORT such as 127.0.0.1:8001, not a URL" in caplog.text


def test_infer_random_and_errors(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert mha(["infer", "--url", server.url, "--shape", "1,4,32"]) == 0
    assert "output [1, 4, 32]" in capsys.readouterr().out
    assert mha(["infer", "--url", server.url, "--shape", "1,4,31"]) == 1
    assert mha(["infer", "--url", server.url, "--shape", "one,4"]) == 2


def test_infer_sends_the_id_the_server_logs_it_under(
    server: ServerThread, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`--id`: the call's line in the server's log carries it (a refused call is logged at INFO),
    and `mha infer` says it, answered or refused, so that one finds the other."""
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger="service.protocol.calls"):
        assert mha(["infer", "--url", server.url, "--shape", "1,4,32", "--id", "probe-7"]) == 0
        assert "(request id 'probe-7')" in capsys.readouterr().out
        assert mha(["infer", "--url", server.url, "--shape", "1,4,31", "--id", "probe-8"]) == 1
        assert "(request id 'probe-8')" in caplog.text

        def calls() -> list[logging.LogRecord]:
            return [r for r in caplog.records if getattr(r, "method", "") == "ModelInfer"]

        until(lambda: bool(calls()), timeout_s=10, what="the call's line is written (once its answer has gone)")
    (line,) = calls()
    assert line.request_id == "probe-8" and line.code == "INVALID_ARGUMENT"


def test_bench_sweeps_concurrency_and_writes_json_and_csv(
    small_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = make_settings(small_model_dir, backend="torch", metrics_port=0)
    with ServerThread(settings) as server:
        args = ["bench", "--url", server.url, "--concurrency", "1,2", "--seconds", "1", "--seq-lens", "4,9"]
        args += ["--metrics-url", f"127.0.0.1:{server.metrics_port}"]  # C comes from the server
        args += ["--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")]
        args += ["--plot", str(tmp_path / "r.png")]
        assert mha(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["clients", "connections", "requests", "req/s"] and "p50 ms" in table[0]
    assert "server CPU ms/req" in table[0] and len(table) == 6  # every column with its unit; 4 runs
    assert [row.split()[:2] for row in table[1:5]] == [[str(n), mode] for n in (1, 2) for mode in CONNECTIONS]
    assert table[5] == f"wrote {tmp_path / 'r.json'}, {tmp_path / 'r.csv'}, {tmp_path / 'r.png'}"
    results = json.loads((tmp_path / "r.json").read_text())
    assert [(r["concurrency"], r["connections"]) for r in results] == [(n, m) for n in (1, 2) for m in CONNECTIONS]
    for r in results:
        assert r["requests"] > 0 and r["errors"] == {} and not r["stopped"]
        assert r["max_ms"] >= r["p99_ms"] >= r["p95_ms"] >= r["p90_ms"] >= r["p50_ms"] > 0
        assert r["server_cpu_ms_per_request"] > 0
    assert (tmp_path / "r.csv").read_text().splitlines()[0].startswith("concurrency,connections,requests")
    png = (tmp_path / "r.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, "a real plot, not an empty image"


def _connections_to(port: int) -> set[str]:
    """The client ends (local addresses) of the established TCP connections to `port` on this
    machine (/proc/net/tcp and tcp6: gRPC may open either)."""
    rows = [line.split() for name in ("tcp", "tcp6") for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]]
    return {row[1] for row in rows if row[2].endswith(f":{port:04X}") and row[3] == "01"}  # remote port, ESTABLISHED


@pytest.mark.parametrize(("connections", "expected"), [("one-channel", 1), ("per-client", 4)])
def test_bench_connects_its_clients_as_asked(server: ServerThread, connections: str, expected: int) -> None:
    """One channel is one connection however many clients share it; per-client, one each."""
    port = int(server.url.rsplit(":", 1)[1])
    args = ["bench", "--url", server.url, "--concurrency", "4", "--seconds", "2", "--metrics-url", "off"]
    earlier = _connections_to(port)  # other tests' channels, which may close at any time
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(mha, [*args, "--connections", connections])
        seen = 0  # the most open at once (the bench asks the server's width on a connection first)
        while not run.done():
            seen = max(seen, len(_connections_to(port) - earlier))
            time.sleep(0.05)
        assert run.result() == 0
    assert seen == expected


def test_load_inputs_are_drawn_once_for_every_sequence_length() -> None:
    pool = input_pool([9, 4, 9], batch=2, d_model=8, seed=3)
    assert list(pool) == [9, 4]  # each length once, in the order given
    for T, inputs in pool.items():
        assert len(inputs) == VARIANTS
        assert all(x.shape == (2, T, 8) and x.dtype == np.float32 and np.isfinite(x).all() for x in inputs)
        assert len({x.tobytes() for x in inputs}) == VARIANTS, "distinct inputs, not one repeated"
    again = input_pool([9, 4, 9], batch=2, d_model=8, seed=3)
    assert all(np.array_equal(a, b) for T in pool for a, b in zip(pool[T], again[T], strict=True))


def test_bench_stops_at_once_with_the_servers_message(
    server: ServerThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = ["bench", "--url", server.url, "--concurrency", "4", "--seconds", "300", "--d-model", "31"]
    args += ["--metrics-url", "off", "--json", str(tmp_path / "r.json")]
    assert mha(args) == 1  # at once: a 300 s run would time the test out
    said = caplog.text
    assert "stopped: the server refused the requests: INVALID_ARGUMENT" in said and "expected C = 32" in said
    assert not (tmp_path / "r.json").exists()


def test_serve_reads_its_flags_without_loading_pytorch() -> None:
    """PyTorch's OpenMP runtime reads OMP_WAIT_POLICY once, when PyTorch loads; `mha serve` sets it
    from --thread-spinning after parsing its flags, so parsing them must not load PyTorch. (It did,
    through the model package: a quarter of the server's CPU under load spun in libgomp.)"""
    code = (
        "import sys\n"
        "from service.cli import build_parser\n"
        "from service.settings import settings_from_namespace\n"
        "settings_from_namespace(build_parser({}).parse_args(['serve', '--workers', '2']), 'INFO')\n"
        "print('torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False", "parsing `mha serve`'s flags loaded PyTorch"


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "--out", "{tmp}/m", "--d-model", "0"],
        ["export", "--out", "{tmp}/m", "--precision", "fp8"],
        ["export", "--out", "{tmp}/m", "--d-model", "100000000", "--max-seq-len", "100000"],
        ["verify", "{tmp}/no-such-model"],
        ["verify", "{tmp}", "--http-url", "http://127.0.0.1:1"],
        ["tune", "--model-dir", "{tmp}/no-such-model", "--shape", "1,16,32", "--p99-ms", "5"],
        ["tune", "--model-dir", "{model}", "--shape", "1,16,64", "--p99-ms", "5"],
        ["tune", "--model-dir", "{model}", "--shape", "1,65,32", "--p99-ms", "5"],
        ["tune", "--model-dir", "{model}", "--shape", "1,16,32", "--p99-ms", "5", "--out", "{tmp}/a-file"],
    ],
    ids=[
        "width-zero",
        "unknown-precision",
        "too-large-to-check",
        "no-such-directory",
        "http-url-alone",
        "tune-no-model",
        "tune-shape-too-wide",
        "tune-shape-too-long",
        "tune-out-a-file",
    ],
)
def test_export_verify_and_tune_refuse_bad_arguments_before_loading_pytorch(
    argv: list[str], tmp_path: Path, small_model_dir: Path
) -> None:
    """A mistake in the arguments is said in a fraction of a second, not after the seconds that
    loading PyTorch and onnx takes, and exits 2."""
    (tmp_path / "a-file").write_text("")
    given = [arg.replace("{tmp}", str(tmp_path)).replace("{model}", str(small_model_dir)) for arg in argv]
    code = (
        "import sys\n"
        "from service.cli import main\n"
        f"code = main({given!r})\n"
        "print(code, 'torch' in sys.modules, 'onnx' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.split()[-3:] == ["2", "False", "False"], run.stdout + run.stderr


def test_a_command_leaves_what_it_built_to_the_process_end(caplog: pytest.LogCaptureFixture) -> None:
    """Frozen as the command returns: the interpreter's last collection then passes PyTorch's and
    ONNX Runtime's objects by (an export or a verify ends about half a second sooner)."""
    gc.unfreeze()
    assert mha(["infer", "stray"]) == 2  # refused as a mistake: frozen all the same
    assert "unexpected argument 'stray'" in caplog.text
    assert gc.get_freeze_count() > 0
