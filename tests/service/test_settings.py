"""Flags and MHA_* variables build one Settings object, checked whenever one is made."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from service.settings import Settings, add_serve_arguments, settings_from_namespace
from tests.support import ROOT


def _parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(parser, environ)
    return parser


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    return settings_from_namespace(_parser(environ or {}).parse_args(argv), "info")


def test_env_and_flags() -> None:
    env = {
        "MHA_GRPC_PORT": "9001",
        "MHA_MAX_QUEUE_DELAY_MS": "0.5",
        "MHA_MODEL_DIR": "/models/x",
        "MHA_BACKEND": "torch",
    }
    s = _parse([], env)
    assert (s.grpc_port, s.max_queue_delay_ms, s.model_dir, s.backend) == (9001, 0.5, Path("/models/x"), "torch")
    assert _parse(["--grpc-port", "7001"], env).grpc_port == 7001  # the flag wins
    assert s.log_level == "INFO"


def test_every_flagged_setting_has_a_flag_an_env_variable_and_a_documented_default() -> None:
    text = _parser({}).format_help()
    for f in fields(Settings):
        if f.metadata["flag"]:
            flag, env = f"--{f.name.replace('_', '-')}", f"MHA_{f.name.upper()}"
            assert flag in text and env in text, f.name
    assert "(default: 8001)" in text  # argparse shows the declared default itself


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-cert", "c.pem"], "go together"),
        (["--tls-client-ca", "ca.pem"], "needs --tls-cert"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
        (["--grace-s", "-1"], "--grace-s must be >= 0, got -1"),
        (["--grpc-port", "70000"], "--grpc-port must be <= 65535, got 70000"),
        (["--max-padding-ratio", "2"], "--max-padding-ratio must be <= 1, got 2"),
        (["--threads", "-1"], "--threads must be >= 0, got -1"),
        (["--model-name", ""], "--model-name '': expected a name without '/'"),  # before: served, unaddressable
        (["--model-name", "a/b"], "--model-name 'a/b': expected a name without '/'"),  # HTTP routes split it
        (["--sequence-model-name", "mha"], "--sequence-model-name 'mha' is the --model-name too"),  # 2 entries
        (["--grpc-max-connection-age-s", "3000000"], "--grpc-max-connection-age-s must be <= 2.14748e\\+06"),
    ],
)
def test_out_of_bounds_and_bad_combinations_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(argv)


@pytest.mark.parametrize(
    "argv", [["--backend", "tpu"], ["--log-format", "xml"], ["--grpc-port", "abc"]], ids=["choice", "format", "int"]
)
def test_unparsable_flags_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2 and argv[0] in capsys.readouterr().err


FLOAT_SETTINGS = [f for f in fields(Settings) if f.type in ("float", float) and f.metadata["flag"]]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_setting_takes_nan_or_infinity(value: str) -> None:
    """nan and inf parse as floats and pass every bound (nan compares false): before,
    --max-inflight-mb nan crashed the start with a traceback and --max-queue-delay-ms nan served."""
    assert len(FLOAT_SETTINGS) >= 10
    for f in FLOAT_SETTINGS:
        flag, env = f"--{f.name.replace('_', '-')}", {f"MHA_{f.name.upper()}": value}
        with pytest.raises(ValueError, match=f"{flag} must be a finite number, got {value}"):
            _parse([flag, value] if value != "-inf" else [f"{flag}={value}"])
        with pytest.raises(ValueError, match=f"{flag} must be a finite number"):
            _parse([], env)


def test_settings_are_checked_however_they_are_made() -> None:
    """Not only the CLI: a Settings built in code (tests, embedders) is checked the same way."""
    with pytest.raises(ValueError, match="--max-queue-size must be >= 1"):
        Settings(max_queue_size=0)
    with pytest.raises(ValueError, match="--backend 'tpu': expected one of auto, ort-cuda, ort-cpu, torch"):
        replace(Settings(), backend="tpu")


def test_cpu_threads_and_auto_workers_follow_the_cpus_this_process_may_use() -> None:
    """A process confined to one CPU (a container's cpuset) sizes itself for one CPU, whatever the
    host has; --threads wins over it."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from service.settings import Settings; from service.app.supervisor import worker_count;"
        "print(Settings().cpu_threads, Settings(threads=3).cpu_threads, worker_count('auto'))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    gpus = Path("/dev").is_dir() and any(d.name.removeprefix("nvidia").isdigit() for d in Path("/dev").glob("nvidia*"))
    assert run.stdout.split()[:2] == ["1", "3"]
    assert gpus or run.stdout.split()[2] == "1"  # auto: one worker per GPU where there are GPUs


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, False),
        (["--thread-spinning"], {}, True),
        (["--thread-spinning", "false"], {"MHA_THREAD_SPINNING": "1"}, False),
        ([], {"MHA_THREAD_SPINNING": "yes"}, True),
    ],
)
def test_boolean_settings(argv: list[str], env: dict[str, str], expected: bool) -> None:
    assert _parse(argv, env).thread_spinning is expected


def test_a_boolean_is_not_just_any_word(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--thread-spinning", "maybe"])
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err


def test_settings_travel_to_workers_as_flags() -> None:
    from service.settings import to_argv

    argv = ["--grpc-port", "9001", "--backend", "torch", "--thread-spinning", "--model-dir", "/m", "--workers", "3"]
    s = _parse(argv)
    assert _parse(to_argv(s)) == s


@pytest.mark.parametrize("value", ["0", "-1", "many", "2.5", "00", "²", "٣"])  # '²' passes isdigit(), fails int()
def test_workers_is_a_positive_number_or_auto(value: str) -> None:
    with pytest.raises(ValueError, match=f"--workers {value!r}: expected a positive number or auto"):
        _parse(["--workers", value])
    assert _parse(["--workers", "auto"]).workers == "auto"


def test_port_zero_picks_a_free_port_everywhere_and_off_turns_a_port_off() -> None:
    from service.settings import add_serve_arguments, settings_from_namespace, to_argv

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, {"MHA_METRICS_PORT": "off"})
    ns = parser.parse_args(["--grpc-port", "0", "--http-port", "0", "--health-port", "off"])
    settings = settings_from_namespace(ns, "INFO")
    assert (settings.grpc_port, settings.http_port, settings.metrics_port, settings.health_port) == (0, 0, None, None)
    assert (
        settings_from_namespace(parser.parse_args(to_argv(settings)), "INFO") == settings
    )  # off survives a round trip
    with pytest.raises(SystemExit):
        parser.parse_args(["--http-port", "of"])


def test_a_server_reports_the_ports_it_picked(small_model_dir: Path) -> None:
    from tests.support import ServerThread, make_settings

    with ServerThread(make_settings(small_model_dir, backend="torch", http_port=0, metrics_port=0)) as server:
        ports = {server.running.grpc_port, server.http_port, server.metrics_port}  # type: ignore[union-attr]
        assert len(ports) == 3 and 0 not in ports
        for port in ports:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with ServerThread(make_settings(small_model_dir, backend="torch")) as server:  # off: not opened
        assert server.running is not None and server.running.http_port == 0 and server.running.metrics_port == 0


def test_auto_workers_get_a_gpu_each(tmp_path: Path) -> None:
    """A stand-in /dev with three GPUs: three workers, each seeing only its own (no GPU here), and
    told so (an audit's verdict on a GPU then stays with its worker)."""
    from service.app.supervisor import WorkerLaunch, gpu_devices, worker_count

    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    gpus = gpu_devices(tmp_path)
    assert gpus == [0, 1, 2] and worker_count("auto", gpus) == 3
    own = WorkerLaunch([], worker_count("auto", gpus), Settings(workers="auto"), gpus)
    fixed = WorkerLaunch([], 2, Settings(workers="2"), [])  # a number of workers: they share what they see
    try:
        assert [own.environment(w).get("CUDA_VISIBLE_DEVICES") for w in own.workers] == ["0", "1", "2"]
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        assert [fixed.environment(w).get("CUDA_VISIBLE_DEVICES") for w in fixed.workers] == [inherited, inherited]
        assert all("--worker-own-gpu" in own.command(w) for w in own.workers)  # a GPU's verdict its own
        assert not any("--worker-own-gpu" in fixed.command(w) for w in fixed.workers)  # told to the others
    finally:
        own.close()
        fixed.close()


def test_a_pods_gpus_are_numbered_as_cuda_numbers_them_not_by_their_device_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod given the host's /dev/nvidia3 and /dev/nvidia5 sees them as CUDA devices 0 and 1: the
    workers get 0 and 1 (3 and 5 would name devices that do not exist in the pod); an inherited
    CUDA_VISIBLE_DEVICES (GPU UUIDs, as a runtime may set it) is handed out entry by entry."""
    from service.app.supervisor import WorkerLaunch, cuda_devices, gpu_devices

    for name in ("nvidia3", "nvidia5", "nvidiactl"):
        (tmp_path / name).touch()
    gpus = gpu_devices(tmp_path)
    assert gpus == [3, 5]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = WorkerLaunch([], 2, Settings(workers="auto"), gpus)
    assert [launch.environment(w)["CUDA_VISIBLE_DEVICES"] for w in launch.workers] == ["0", "1"]
    launch.close()
    assert cuda_devices(len(gpus), {}) == ["0", "1"]
    assert cuda_devices(2, {"CUDA_VISIBLE_DEVICES": "GPU-aaa, GPU-bbb"}) == ["GPU-aaa", "GPU-bbb"]
    assert cuda_devices(2, {"CUDA_VISIBLE_DEVICES": "7"}) == ["0", "1"]  # fewer than the workers: CUDA's own count


def test_help_lists_the_models_flags_first_and_the_networks_under_a_heading() -> None:
    whole = _parser({}).format_help()
    text = whole[whole.index("\noptions:\n") :]  # past the usage lines
    model, batch, heading = (text.index(flag) for flag in ("--model-dir MODEL_DIR", "--max-batch-size", "\nnetwork:\n"))
    assert model < batch < heading < text.index("--grpc-port GRPC_PORT") < text.index("--tls-cert")
    assert _parse(["--grpc-port", "9001", "--model-dir", "/m"]).grpc_port == 9001  # a group parses as the rest


def test_help_names_each_choice_once_even_one_with_a_comma() -> None:
    text = _parser({}).format_help()
    assert "--shared-memory {off|system|cuda|system,cuda}" in text  # not {off,system,cuda,system,cuda}
    assert _parse(["--shared-memory", "system,cuda"]).shared_memory == "system,cuda"
