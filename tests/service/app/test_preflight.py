"""What a server reads at start, checked before anything heavy loads (`check_before_start`): the
same refusals the server would make once loaded, each naming its file or variable, and nothing
refused that the server would take. The CLI runs it before the supervisor spawns a worker
(tests/service/test_cli_misuse.py runs the same cases end to end)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from service.app.preflight import StartupError, check_before_start
from tests.support import make_settings

GIB = 2**30


def _repository(tmp: Path, config: str) -> Path:
    (tmp / "repo" / "mha").mkdir(parents=True)
    (tmp / "repo" / "mha" / "config.pbtxt").write_text(config)
    return tmp / "repo"


REFUSED = {  # name: (settings given tmp_path, environment, what the refusal must say)
    "tls-cert-not-pem": (
        lambda tmp: {"tls_cert": tmp / "junk", "tls_key": tmp / "junk"},
        {},
        "expected a PEM certificate and the PEM private key that matches it",
    ),
    "auth-token-file-empty": (lambda tmp: {"auth_token_file": tmp / "empty"}, {}, "is empty; expected the bearer"),
    "config-pbtxt-unreadable": (
        lambda tmp: {"model_repository": _repository(tmp, "this is { not pbtxt")},
        {},
        "config.pbtxt is not a model configuration Triton could read",
    ),
    "config-pbtxt-levels-disagree": (
        lambda tmp: {
            "model_repository": _repository(tmp, "dynamic_batching { priority_levels: 2 default_priority_level: 5 }"),
        },
        {},
        "default_priority_level 5 is outside the levels 1..2",
    ),
    "sampler-unknown-while-tracing-is-off": (lambda tmp: {}, {"OTEL_TRACES_SAMPLER": "sometimes"}, "sometimes"),
    "otlp-endpoint-not-a-url": (lambda tmp: {"otlp_endpoint": "collector"}, {}, "expected an OTLP/HTTP URL"),
}


@pytest.mark.parametrize(("overrides", "environ", "says"), REFUSED.values(), ids=REFUSED.keys())
def test_what_the_server_would_refuse_is_refused_before_it_starts(
    overrides, environ: dict[str, str], says: str, tmp_path: Path
) -> None:
    (tmp_path / "junk").write_text("junk")
    (tmp_path / "empty").write_text("\n")
    given = overrides(tmp_path)
    settings = make_settings(None if "model_repository" in given else tmp_path / "model", **given)
    with pytest.raises(StartupError, match=says.replace(".", r"\.").replace("(", r"\(")) as refused:
        check_before_start(settings, environ, 4 * GIB)
    assert refused.value.exit_code == 2


def test_what_the_server_takes_passes(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    good = _repository(tmp_path, "dynamic_batching { priority_levels: 2 default_priority_level: 1 }")
    settings = make_settings(None, model_repository=good, auth_token_file=tmp_path / "token")
    environ = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "not checked while the SDK is off"}
    check_before_start(settings, environ, 4 * GIB)


def test_the_checks_load_neither_onnx_runtime_nor_pytorch() -> None:
    """The supervisor runs them: importing them must not bring the compute libraries in."""
    import subprocess

    code = "import sys, service.app.preflight; print(sorted({'torch', 'onnxruntime'} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]", run.stdout


def test_a_budget_beyond_the_memory_limit_is_taken_with_a_warning(tmp_path: Path, caplog) -> None:
    """The operator's choice, but the kernel would kill the server for memory before the budget
    refused a request: said once, at start."""
    check_before_start(make_settings(tmp_path, max_inflight_mb=3072), {}, 4 * GIB)
    assert not caplog.records
    check_before_start(make_settings(tmp_path, max_inflight_mb=5000), {}, 4 * GIB)
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and "--max-inflight-mb 5000 is more than the memory limit (4096 MiB)" in (
        warning.getMessage()
    )
