"""Every way a person gets `mha` wrong answers one line that says what and why, no traceback;
exit code 2 for a wrong command line, 1 for work that failed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import ServerThread, free_port, make_settings


def _mha(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **(env or {})}
    command = [sys.executable, "-m", "service.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environ, cwd=cwd)


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture(scope="module")
def small_server(small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as s:
        yield s


def _same_token(path: Path) -> list[str]:
    return ["--auth-token-file", str(path), "--admin-token-file", str(path)]


def _serve(model_dir: Path, *extra: str) -> list[str]:
    return ["serve", "--model-dir", str(model_dir), "--host", "127.0.0.1", "--log-format", "text", *extra]


def _repository(tmp: Path, config: str) -> list[str]:
    """`serve` of a repository whose model's config.pbtxt is `config` (no version: it is refused first)."""
    (tmp / "repo" / "mha").mkdir(parents=True, exist_ok=True)
    (tmp / "repo" / "mha" / "config.pbtxt").write_text(config)
    return ["serve", "--model-repository", str(tmp / "repo"), "--host", "127.0.0.1", "--log-format", "text"]


def _zero_bytes(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _corrupt(directory: Path) -> Path:
    """A model directory whose weights are not safetensors: found only once the server loads it."""
    (directory / "weights.safetensors").write_bytes(b"not safetensors")
    return directory


WRONG_FD = ("--worker-metrics-fd", "987")  # a descriptor the process was not given
CASES = {  # name: (arguments given the fixtures, environment, exit code, what the message must say)
    "grpc-port-taken": (
        lambda f: _serve(f["model"], "--grpc-port", str(f["taken"]), "--metrics-port", "off"),
        {},
        1,
        "the port is in use by another process; stop what holds it, or choose another with --grpc-port",
    ),
    "metrics-port-taken": (
        lambda f: _serve(f["model"], "--grpc-port", str(free_port()), "--metrics-port", str(f["taken"])),
        {},
        1,
        "--metrics-port",
    ),
    "worker-metrics-fd-not-open": (  # a flag the supervisor sets, given by hand
        lambda f: _serve(f["model"], "--grpc-port", "0", "--http-port", "off", "--workers", "1", *WRONG_FD),
        {},
        1,
        "--worker-metrics-fd 987: Bad file descriptor",
    ),
    "worker-wait-fd-not-open": (  # another flag the supervisor sets, given by hand
        lambda f: _serve(f["model"], "--grpc-port", "0", "--metrics-port", "off", "--worker-wait-fd", "987"),
        {},
        2,
        "--worker-wait-fd 987: Bad file descriptor",
    ),
    "worker-wait-fd-not-a-pipe-to-read": (  # standard error (captured: a pipe's end to write), not one to read
        lambda f: _serve(f["model"], "--grpc-port", "0", "--metrics-port", "off", "--worker-wait-fd", "2"),
        {},
        2,
        "--worker-wait-fd 2: expected the read end of a pipe",
    ),
    "parent-pid-not-the-parent": (  # a flag the supervisor and `mha tune` set, naming another process
        lambda f: _serve(f["model"], "--grpc-port", "0", "--metrics-port", "off", "--parent-pid", "1"),
        {},
        1,
        "--parent-pid 1 is not the process that started this one",
    ),
    "auth-token-file-missing": (
        lambda f: _serve(f["model"], "--grpc-port", "0", "--metrics-port", "off", "--auth-token-file", "/nope/token"),
        {},
        2,
        "--auth-token-file /nope/token",
    ),
    "admin-token-is-the-auth-token": (  # any client holding the one token could then make control calls
        lambda f: _serve(
            f["model"], "--grpc-port", "0", "--metrics-port", "off", *_same_token(f["model"] / "manifest.json")
        ),
        {},
        2,
        "--admin-token-file holds a --auth-token-file token: any client could make control calls",
    ),
    "host-not-this-machines": (  # before, with --workers: ": Name or service not known", no flag named
        lambda f: _serve(f["model"], "--grpc-port", "0", "--http-port", "0", "--host", "999.1.1.1"),
        {},
        1,
        "--grpc-port: cannot listen on 999.1.1.1:0: '999.1.1.1' is not an address of this machine",
    ),
    "workers-beyond-memory": (  # before: 1,000 processes started, then killed for memory, then restarted
        lambda f: _serve(f["model"], "--grpc-port", "0", "--http-port", "0", "--workers", "1000"),
        {},
        2,
        "--workers 1000: each worker holds about",
    ),
    "otlp-endpoint-not-a-url": (
        lambda f: _serve(f["model"], "--grpc-port", "0", "--metrics-port", "off", "--otlp-endpoint", "collector"),
        {},
        2,
        "--otlp-endpoint 'collector': expected an OTLP/HTTP URL",
    ),
    "host-empty": (
        lambda f: _serve(f["model"], "--grpc-port", "0", "--metrics-port", "off", "--host", ""),
        {},
        1,
        "the host is empty; give an address such as 0.0.0.0 or 127.0.0.1",
    ),
    "tls-cert-missing": (
        lambda f: _serve(f["model"], "--grpc-port", "0", "--tls-cert", "/nope/c.pem", "--tls-key", "/nope/k.pem"),
        {},
        2,
        "--tls-cert /nope/c.pem",
    ),
    "config-pbtxt-unreadable": (  # before this case: a traceback from the server's start
        lambda f: [*_repository(f["tmp"], "this is { not pbtxt"), "--grpc-port", "0", "--metrics-port", "off"],
        {},
        2,
        "config.pbtxt is not a model configuration Triton could read",
    ),
    "model-repository-without-versions": (  # before: the reason twice, the loader's line and the start's
        lambda f: [*_repository(f["tmp"], ""), "--grpc-port", "0", "--metrics-port", "off"],
        {},
        1,
        "holds no version folder (1/, 2/, ...), and its version_policy serves the latest 1 version",
    ),
    "config-pbtxt-levels-disagree": (
        lambda f: [
            *_repository(f["tmp"], "dynamic_batching { priority_levels: 2 default_priority_level: 5 }"),
            "--grpc-port",
            "0",
            "--metrics-port",
            "off",
        ],
        {},
        2,
        "default_priority_level 5 is outside the levels 1..2",
    ),
    "log-level-variable-unknown": (  # before this case: a traceback from logging (argparse checked only the flag)
        lambda f: _serve(f["model"], "--grpc-port", "0"),
        {"MHA_LOG_LEVEL": "loud"},
        2,
        "MHA_LOG_LEVEL 'LOUD': expected one of DEBUG, INFO, WARNING, ERROR",
    ),
    "grpc-port-out-of-range": (
        lambda f: _serve(f["model"], "--grpc-port", "70000"),
        {},
        2,
        "--grpc-port must be <= 65535",
    ),
    "connection-grace-without-age": (  # gRPC would apply no grace without an age: refused, not ignored
        lambda f: _serve(
            f["model"], "--grpc-port", "0", "--metrics-port", "off", "--grpc-max-connection-age-grace-s", "5"
        ),
        {},
        2,
        "--grpc-max-connection-age-grace-s is a grace after --grpc-max-connection-age-s: set both",
    ),
    "padding-ratio-out-of-range": (lambda f: _serve(f["model"], "--max-padding-ratio", "2"), {}, 2, "must be <= 1"),
    "threads-negative": (lambda f: _serve(f["model"], "--threads", "-1"), {}, 2, "--threads must be >= 0"),
    "threads-by-the-thousand": (  # before this case: every thread made, and no process on the machine could fork
        lambda f: _serve(f["model"], "--threads", "100000"),
        {},
        2,
        "--threads 100000: more intra-op threads than 4 per CPU this process may use",
    ),
    "message-size-past-grpcs-int": (  # before this case: a traceback from gRPC, OverflowError
        lambda f: _serve(f["model"], "--max-message-mb", "100000"),
        {},
        2,
        "--max-message-mb must be <= 2047",
    ),
    "model-dir-missing": (lambda f: _serve(f["tmp"] / "none"), {}, 2, "no such directory; export one with"),
    "poll-without-repository": (
        lambda f: _serve(f["model"], "--model-control-mode", "poll"),
        {},
        2,
        "--model-control-mode poll follows a repository: give --model-repository",
    ),
    "repository-and-model-dir": (
        lambda f: _serve(f["model"], "--model-repository", str(f["tmp"])),
        {},
        2,
        "--model-repository and --model-dir are two sources of versions",
    ),
    "repository-missing": (
        lambda f: ["serve", "--model-repository", str(f["tmp"] / "none"), "--log-format", "text"],
        {},
        2,
        "no such directory; lay versions out as DIR/<model-name>/<version>/",
    ),
    "load-model-unknown": (
        lambda f: [
            "serve",
            "--model-repository",
            str(f["tmp"]),
            "--model-control-mode",
            "explicit",
            "--load-model",
            "gpt",
        ],
        {},
        2,
        "--load-model 'gpt': this server serves 'mha'",
    ),
    "model-dir-a-file": (lambda f: _serve(f["model"] / "weights.safetensors"), {}, 2, "is a file, not a directory"),
    "model-dir-empty": (lambda f: _serve(f["tmp"]), {}, 2, "holds no exported model"),
    "model-dir-corrupt": (
        lambda f: _serve(_corrupt(f["tmp"]), "--grpc-port", "0", "--http-port", "off", "--metrics-port", "off"),
        {},
        1,
        "cannot serve",
    ),
    "trace-sampler-unknown": (
        lambda f: _serve(f["model"], "--grpc-port", "0", "--otlp-endpoint", "http://127.0.0.1:9"),
        {"OTEL_TRACES_SAMPLER": "sometimes"},
        2,
        "OTEL_TRACES_SAMPLER='sometimes': expected one of always_on",
    ),
    "trace-sampler-unknown-tracing-off": (
        lambda f: _serve(f["model"], "--grpc-port", "0"),
        {"OTEL_TRACES_SAMPLER": "sometimes"},
        2,
        "OTEL_TRACES_SAMPLER='sometimes': expected one of always_on",
    ),
    "triton-backend-directory": (
        lambda f: _serve(f["model"], "--backend-directory", "/opt/tritonserver/backends"),
        {},
        2,
        "--backend-directory is Triton's: backends are built in: choose one with --backend",
    ),
    "grpc-port-not-a-number": (lambda f: _serve(f["model"], "--grpc-port", "abc"), {}, 2, "--grpc-port: invalid"),
    "infer-url-without-flag": (lambda f: ["infer", f["url"]], {}, 2, "give the server as --url"),
    "infer-timeout-negative": (
        lambda f: ["infer", "--url", f["url"], "--timeout", "-1"],
        {},
        2,
        "--timeout -1: expected a positive, finite number of seconds",
    ),
    # nan and inf parse as floats: before, bench ran a level of nan seconds and printed a table
    # of nothing, and inf seconds never ended
    "bench-seconds-nan": (
        lambda f: ["bench", "--url", f["url"], "--seconds", "nan"],
        {},
        2,
        "--seconds nan: expected a positive, finite number",
    ),
    "bench-seconds-inf": (lambda f: ["bench", "--url", f["url"], "--seconds", "inf"], {}, 2, "--seconds inf: expected"),
    "bench-no-server": (  # before: "...; pass --d-model", which only ran a load of refused requests
        lambda f: ["bench", "--url", f"127.0.0.1:{free_port()}", "--seconds", "1", "--metrics-url", "off"],
        {},
        1,
        "no gRPC server answers at 127.0.0.1:",
    ),
    "bench-port-speaks-no-grpc": (  # a socket that accepts and never answers
        lambda f: ["bench", "--url", f"127.0.0.1:{f['taken']}", "--seconds", "1", "--metrics-url", "off"],
        {},
        1,
        "DEADLINE_EXCEEDED: Deadline Exceeded; start one (`mha serve`), or give its --url",
    ),
    "bench-clients-by-the-thousand": (  # before this case: a thread each until the machine could start no more
        lambda f: ["bench", "--url", f["url"], "--concurrency", "1,100000"],
        {},
        2,
        "--concurrency 1,100000: at most 1024 clients",
    ),
    "bench-batch-zero": (lambda f: ["bench", "--url", f["url"], "--batch", "0"], {}, 2, "--batch 0: expected B >= 1"),
    "bench-batch-over-the-servers-rows": (  # before: minutes building a 3 GB request, then refused
        lambda f: ["bench", "--url", f["url"], "--batch", "100000"],
        {},
        2,
        "--batch 100000: the server at",
    ),
    "bench-seq-over-the-servers-longest": (
        lambda f: ["bench", "--url", f["url"], "--seq-lens", "8,65"],
        {},
        2,
        "--seq-lens 8,65: the server at",
    ),
    "pod-cost-interval-nan": (lambda f: ["pod-cost", "--interval-s", "nan"], {}, 2, "--interval-s nan: expected"),
    "env-port-not-a-number": (lambda f: _serve(f["model"]), {"MHA_GRPC_PORT": "abc"}, 2, "--grpc-port: invalid"),
    "log-level-unknown": (lambda f: ["--log-level", "LOUD", "serve"], {}, 2, "--log-level: invalid choice"),
    "infer-input-missing": (lambda f: ["infer", "--input", "/nope/x.npy"], {}, 2, "--input /nope/x.npy"),
    "infer-input-complex": (  # before: the imaginary parts dropped with a warning, and an answer
        lambda f: ["infer", "--url", f["url"], "--input", str(f["complex"])],
        {},
        2,
        "holds complex64; expected real numbers",
    ),
    "infer-shape-over-one-message": (  # before this case: a minute and 13 GB building it, then killed or refused
        lambda f: ["infer", "--url", f["url"], "--shape", "100000000,1,32"],
        {},
        2,
        "12,207 MiB of float32, over the 64 MiB one request may carry",
    ),
    "infer-input-empty-file": (  # before this case: a traceback, EOFError
        lambda f: ["infer", "--url", f["url"], "--input", str(_zero_bytes(f["tmp"] / "zero.npy"))],
        {},
        2,
        "zero.npy: No data left in file; expected a .npy file",
    ),
    "infer-shape-negative": (
        lambda f: ["infer", "--url", f["url"], "--shape", "1,-1,128"],
        {},
        2,
        "--shape '1,-1,128': expected B,T,C such as 1,64,128 (negative dimensions are not allowed)",
    ),
    "infer-token-file-empty": (  # before this case: a traceback, the file read as no token at all
        lambda f: ["infer", "--url", f["url"], "--token-file", str(f["empty"])],
        {},
        2,
        "is empty; expected the bearer token clients must send",
    ),
    "infer-token-file-missing": (
        lambda f: ["infer", "--url", f["url"], "--token-file", "/nope/token"],
        {},
        2,
        "/nope/token: No such file",
    ),
    "infer-tls-ca-missing": (  # before: "/nope/ca.pem: No such file or directory", the flag unnamed
        lambda f: ["infer", "--url", f["url"], "--tls-ca", "/nope/ca.pem"],
        {},
        2,
        "--tls-ca /nope/ca.pem: No such file or directory",
    ),
    "infer-client-cert-without-key": (  # before: the certificate silently not sent
        lambda f: ["infer", "--url", f["url"], "--tls-ca", str(f["empty"]), "--tls-client-cert", str(f["empty"])],
        {},
        2,
        "--tls-client-cert and --tls-client-key go together (mTLS); give both or neither",
    ),
    "infer-server-name-without-tls": (
        lambda f: ["infer", "--url", f["url"], "--tls-server-name", "mha-serve.serving.svc"],
        {},
        2,
        "--tls-client-cert and --tls-server-name are for TLS: give --tls-ca too",
    ),
    "verify-no-such-directory": (  # before: an empty parity table, "FAIL: tolerance 1e-05", exit 1
        lambda f: ["verify", str(f["tmp"] / "nope")],
        {},
        2,
        "nope: no such directory; export one with `mha export --out",
    ),
    "verify-url-no-such-directory": (  # before this case: a traceback, CheckpointError
        lambda f: ["verify", str(f["tmp"] / "nope"), "--url", f["url"]],
        {},
        2,
        "nope: no such directory; export one with `mha export --out",
    ),
    "verify-url-weights-corrupt": (  # before this case: a traceback, CheckpointError
        lambda f: ["verify", str(_corrupt(f["tmp"])), "--url", f["url"]],
        {},
        2,
        "give the model directory the server serves",
    ),
    "verify-not-a-model-directory": (
        lambda f: ["verify", str(f["tmp"])],
        {},
        2,
        "holds no exported model (no weights.safetensors)",
    ),
    "verify-server-down": (
        lambda f: ["verify", str(f["model"]), "--url", f"127.0.0.1:{f['taken']}"],
        {},
        1,
        "cannot verify the server at",
    ),
    "verify-server-of-another-width": (
        lambda f: ["verify", str(f["default"]), "--url", f["url"]],
        {},
        1,
        "it serves C = 32",
    ),
    "verify-url-is-a-url": (  # before: gRPC's "address lookup failed for http://...", exit 1
        lambda f: ["verify", str(f["model"]), "--url", f"http://{f['url']}"],
        {},
        2,
        "expected the gRPC HOST:PORT such as 127.0.0.1:8001, not a URL",
    ),
    "verify-http-url-without-url": (
        lambda f: ["verify", str(f["model"]), "--http-url", "http://127.0.0.1:8000"],
        {},
        2,
        "--http-url checks a running server's HTTP routes beside its gRPC ones: give --url too",
    ),
    "verify-http-url-not-a-url": (  # before --http-url took a scheme, a HOST:PORT was the natural guess
        lambda f: ["verify", str(f["model"]), "--url", f["url"], "--http-url", "127.0.0.1:8000"],
        {},
        2,
        "--http-url '127.0.0.1:8000': expected http://HOST:PORT or https://HOST:PORT",
    ),
    "verify-https-without-a-ca": (
        lambda f: ["verify", str(f["model"]), "--url", f["url"], "--http-url", "https://127.0.0.1:8000"],
        {},
        2,
        "--http-url https://... needs --tls-ca, the CA that signed the server's certificate",
    ),
    "verify-https-ca-not-a-certificate": (
        lambda f: [
            "verify",
            str(f["model"]),
            "--url",
            f["url"],
            "--tls-ca",
            str(f["empty"]),
            "--http-url",
            "https://127.0.0.1:8000",
        ],
        {},
        2,
        "--tls-ca, --tls-client-cert or --tls-client-key for --http-url:",
    ),
    "export-unknown-layer": (
        lambda f: [
            "export",
            "--out",
            str(f["tmp"] / "new"),
            "--checkpoint",
            str(f["gpt2"]),
            "--import-prefix",
            "h.9.attn.",
            "--n-head",
            "2",
        ],
        {},
        2,
        "no layer 'h.9.attn.' in this file",
    ),
    "export-out-a-file": (  # before this case: "PATH: Not a directory", the flag unnamed
        lambda f: ["export", "--out", str(f["model"] / "weights.safetensors")],
        {},
        2,
        "weights.safetensors is a file: name a directory",
    ),
    "export-checkpoint-a-directory": (  # before this case: "no such file"
        lambda f: ["export", "--out", str(f["tmp"] / "new"), "--checkpoint", str(f["tmp"])],
        {},
        2,
        ": a directory, not a file",
    ),
    "export-over-a-model": (lambda f: ["export", "--out", str(f["model"])], {}, 2, "pass --force"),
    "export-zero-width": (lambda f: ["export", "--out", str(f["tmp"] / "zero"), "--d-model", "0"], {}, 2, "d_model"),
    "export-longer-than-memory": (
        lambda f: ["export", "--out", str(f["tmp"] / "long"), "--max-seq-len", "100000000"],
        {},
        2,
        "Give a smaller --max-seq-len or --d-model",
    ),
    "export-wider-than-memory": (
        lambda f: ["export", "--out", str(f["tmp"] / "wide"), "--d-model", "1000000"],
        {},
        2,
        "GiB (the attention scores of B = 7 rows of T = max_seq_len, and the weights); this machine allows",
    ),
    "export-checkpoint-longer-than-memory": (
        lambda f: [
            "export",
            "--out",
            str(f["tmp"] / "ck"),
            "--checkpoint",
            str(f["model"] / "weights.safetensors"),
            "--max-seq-len",
            "100000000",
        ],
        {},
        2,
        "--d-model 32 with --max-seq-len 100000000: checking the model against the float64 references",
    ),
    "export-checkpoint-and-new-weights": (
        lambda f: [
            "export",
            "--out",
            str(f["tmp"] / "both"),
            "--checkpoint",
            str(f["model"] / "weights.safetensors"),
            "--seed",
            "3",
            "--no-bias",
        ],
        {},
        2,
        "--no-bias, --seed say how to make new weights",
    ),
}


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("gpt2") / "gpt2.safetensors"
    C = 16
    save_file({"h.0.attn.c_attn.weight": torch.randn(C, 3 * C), "h.0.attn.c_proj.weight": torch.randn(C, C)}, path)
    return path


@pytest.mark.parametrize(("make_args", "env", "code", "says"), CASES.values(), ids=CASES.keys())
def test_misuse_gets_one_clear_line(
    make_args,
    env: dict[str, str],
    code: int,
    says: str,
    small_model_dir: Path,
    default_model_dir: Path,
    taken_port: int,
    small_server: ServerThread,
    gpt2_checkpoint: Path,
    tmp_path: Path,
) -> None:
    np.save(complex_input := tmp_path / "complex.npy", np.ones((1, 4, 32), dtype=np.complex64))
    (empty := tmp_path / "empty").write_text("\n")
    fixtures = {
        "complex": complex_input,
        "empty": empty,
        "model": small_model_dir,
        "default": default_model_dir,
        "taken": taken_port,
        "url": small_server.url,
        "gpt2": gpt2_checkpoint,
        "tmp": tmp_path,
    }
    run = _mha(*make_args(fixtures), env=env)
    assert run.returncode == code, run.stderr[-2000:]
    assert says in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines  # the cause and the fix: no usage, no start-up and drain narration


@pytest.mark.parametrize(
    "case",
    [
        "grpc-port-taken",
        "metrics-port-taken",
        "model-dir-corrupt",
        "tls-cert-missing",
        "config-pbtxt-unreadable",
        "config-pbtxt-levels-disagree",
        "model-repository-without-versions",
        "trace-sampler-unknown",
        "connection-grace-without-age",
        "threads-by-the-thousand",
    ],
)
def test_with_workers_a_failed_start_is_still_one_line(
    case: str, small_model_dir: Path, taken_port: int, tmp_path: Path
) -> None:
    """Under the supervisor (--workers, the default wherever there are 2 CPUs or more), the same
    one line and exit code: the ports are checked before any worker starts, and only the first worker
    loads until it has, so a start that fails is reported once, by the worker that tried."""
    make_args, env, code, says = CASES[case]
    fixtures = {"model": small_model_dir, "taken": taken_port, "tmp": tmp_path}
    run = _mha(*make_args(fixtures), "--workers", "2", env=env)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == code and len(lines) == 1, lines
    assert says in lines[0]


@pytest.mark.parametrize(
    "fault", ["model-dir-missing", "grpc-port-taken", "grpc-port-out-of-range", "port-not-a-number"]
)
def test_off_a_terminal_a_failed_start_is_one_json_line(
    fault: str, small_model_dir: Path, taken_port: int, tmp_path: Path
) -> None:
    args = {
        "model-dir-missing": ["--model-dir", str(tmp_path / "none")],
        "grpc-port-taken": ["--model-dir", str(small_model_dir), "--grpc-port", str(taken_port)],
        "grpc-port-out-of-range": ["--model-dir", str(small_model_dir), "--grpc-port", "70000"],
        "port-not-a-number": ["--model-dir", str(small_model_dir), "--grpc-port", "abc"],  # argparse's own
    }[fault]
    run = _mha("serve", "--host", "127.0.0.1", "--metrics-port", "off", "--http-port", "off", *args)  # auto: JSON
    lines = run.stderr.splitlines()
    assert run.returncode != 0 and len(lines) == 1, lines
    entry = json.loads(lines[0])  # before: "E1130 ... add_port.cc" beside it, or a plain-text settings error
    assert entry["level"] == "ERROR" and "--" in entry["msg"], entry


def test_text_lines_without_a_request_carry_no_empty_tag() -> None:
    import io
    import logging

    from service.logs import configure_logging, request_id_var

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO", "text")
        stream = io.StringIO()
        root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        logging.getLogger("t").info("no request here")
        token = request_id_var.set("abc123")
        logging.getLogger("t").info("in a request")
        request_id_var.reset(token)
    finally:
        root.handlers[:], root.level = handlers, level
    first, second = stream.getvalue().splitlines()
    assert first.endswith("INFO t no request here") and "[]" not in first, first
    assert second.endswith("INFO t [abc123] in a request"), second


def test_a_clients_request_id_stays_one_cut_line_of_text() -> None:
    from service.logs import new_request_id

    assert new_request_id("trace-42") == "trace-42"
    forged = "a\n2026-12-04 ERROR forged line\x1b[31m" + "z" * 100
    assert new_request_id(forged) == ("a?2026-12-04 ERROR forged line?[31m" + "z" * 100)[:64]
    assert new_request_id("")  # none sent: a fresh one


def test_infer_and_verify_at_the_http_port_say_which_port_to_use(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0)) as server:
        at_http = f"127.0.0.1:{server.http_port}"
        runs = [_mha("infer", "--url", at_http, "--shape", "1,4,32", "--timeout", "10")]
        runs.append(_mha("verify", str(small_model_dir), "--url", at_http))
    hint = "answers HTTP/1.1: is it the HTTP port? --url takes the gRPC port (default 8001)"
    for run in runs:
        assert run.returncode == 1 and hint in run.stderr, run.stderr


@pytest.mark.parametrize("limit_kib", [8, 24])  # the weights (16 KiB) cannot be written; then the ONNX graph
def test_an_export_the_disk_cannot_hold_says_where_and_leaves_the_model_before_it(
    limit_kib: int, small_model_dir: Path, tmp_path: Path
) -> None:
    """A full disk (here: a file size limit, RLIMIT_FSIZE) met while writing: one line naming the
    directory, exit 1 (the machine's refusal, not a usage error), and the model already there intact.
    Before: a SafetensorError traceback, or ': No space left on device' with exit 2."""
    out = tmp_path / "model"
    out.mkdir()
    for f in small_model_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    # the limit set by a small interpreter that then execs the export: never in a preexec_fn, which
    # runs Python between fork and exec in this process, where gRPC's threads may be at work
    limit = f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_kib * 1024},) * 2); "
    limit += "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    command = [sys.executable, "-c", limit, "-m", "service.cli", "export", "--out", str(out), "--force"]
    command += ["--d-model", "32", "--n-head", "4", "--max-seq-len", "64"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot write the model to {out}: " in errors[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
