"""Triton's operator flags on `mha serve`: aliases where the meaning is ours, one line naming our
equivalent where it is not (the misuse table in test_cli_misuse.py runs them end to end)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.app.triton_flags import OFF_HERE, REFUSED, translated, triton_flag
from service.cli import build_parser
from service.settings import settings_from_namespace


class Refused(Exception):
    pass


def _refuse(message: str) -> None:
    raise Refused(message)


def test_flags_with_our_meaning_are_translated() -> None:
    argv = ["serve", "--model-store=/m", "--exit-timeout-secs", "5", "--allow-http=false", "--allow-metrics", "false"]
    argv += ["--log-verbose=1", "--strict-readiness=true", "--allow-grpc", "true", "--threads", "2"]
    assert translated(argv, _refuse) == [
        "--log-level",
        "DEBUG",
        "serve",
        "--model-repository",
        "/m",
        "--grace-s",
        "5",
        "--http-port",
        "off",
        "--metrics-port",
        "off",
        "--threads",
        "2",
    ]
    args = build_parser(os.environ).parse_args(translated(argv, _refuse))
    settings = settings_from_namespace(args, args.log_level)
    assert (settings.model_repository, settings.grace_s, settings.http_port, settings.metrics_port) == (
        Path("/m"),
        5.0,
        None,
        None,
    )
    assert args.log_level == "DEBUG"


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flags_without_our_meaning_name_the_equivalent(flag: str) -> None:
    equivalent = "(use|backends|there|HTTP|traces|the config|metrics|versions|gRPC|answers|logs)"
    with pytest.raises(Refused, match=rf"^{flag} is Triton's: {equivalent}"):
        translated(["serve", f"{flag}=x"], _refuse)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--allow-grpc=false"], "the gRPC port cannot be turned off here"),
        (["serve", "--strict-readiness", "false"], "readiness here is always strict"),
        (["serve", "--allow-http=maybe"], "expected true or false"),
        (["serve", "--exit-timeout-secs"], "needs a value"),
        (["serve", "--log-warning=false"], "mha --log-level WARNING serve"),
    ],
)
def test_triton_values_we_cannot_honour_are_refused(argv: list[str], says: str) -> None:
    with pytest.raises(Refused, match=says):
        translated(argv, _refuse)


def test_other_commands_and_our_flags_pass_untouched() -> None:
    assert translated(["export", "--out", "m", "--id", "x"], _refuse) == ["export", "--out", "m", "--id", "x"]
    assert translated(["serve", "--grace-s", "3"], _refuse) == ["serve", "--grace-s", "3"]


def test_connection_ages_in_milliseconds_become_ours_in_seconds() -> None:
    argv = ["serve", "--grpc-max-connection-age=300000", "--grpc-max-connection-age-grace", "123456789"]
    translation = translated(argv, _refuse)
    assert translation == [
        "serve",
        "--grpc-max-connection-age-s",
        "300.0",
        "--grpc-max-connection-age-grace-s",
        "123456.789",
    ]
    settings = settings_from_namespace(build_parser({}).parse_args(translation), "INFO")
    assert (settings.grpc_max_connection_age_s, settings.grpc_max_connection_age_grace_s) == (300.0, 123456.789)
    for value in ("1.5", "-3", "5m", "\u0661"):  # Triton's flag takes whole milliseconds, ASCII digits
        with pytest.raises(Refused, match="expected whole milliseconds"):
            translated(["serve", f"--grpc-max-connection-age={value}"], _refuse)


def test_the_pings_triton_lets_clients_send_are_ours_to_allow_too() -> None:
    argv = ["serve", "--grpc-http2-min-recv-ping-interval-without-data=10000"]
    translation = translated([*argv, "--grpc-keepalive-permit-without-calls=1"], _refuse)
    assert translation[1:] == ["--grpc-client-ping-interval-s", "10.0", "--grpc-pings-without-calls", "true"]
    settings = settings_from_namespace(build_parser({}).parse_args(translation), "INFO")
    assert (settings.grpc_client_ping_interval_s, settings.grpc_pings_without_calls) == (10.0, True)
    assert translated(["serve", "--grpc-keepalive-permit-without-calls", "false"], _refuse)[1:] == [
        "--grpc-pings-without-calls",
        "false",
    ]
    with pytest.raises(Refused, match="expected true or false"):
        translated(["serve", "--grpc-keepalive-permit-without-calls=maybe"], _refuse)


def test_the_servers_own_keepalive_pings_take_tritons_flags() -> None:
    """Triton's --grpc-keepalive-time and --grpc-keepalive-timeout (milliseconds, Triton's defaults
    here) become ours in seconds; the ping-count flags stay refused, naming what allows pings."""
    translation = translated(["serve", "--grpc-keepalive-time=7200000", "--grpc-keepalive-timeout", "20000"], _refuse)
    assert translation[1:] == ["--grpc-keepalive-time-s", "7200.0", "--grpc-keepalive-timeout-s", "20.0"]
    settings = settings_from_namespace(build_parser({}).parse_args(translation), "INFO")
    assert (settings.grpc_keepalive_time_s, settings.grpc_keepalive_timeout_s) == (7200.0, 20.0)
    with pytest.raises(Refused, match="expected whole milliseconds"):
        translated(["serve", "--grpc-keepalive-timeout=20s"], _refuse)
    for flag in ("--grpc-http2-max-pings-without-data", "--grpc-http2-max-ping-strikes"):
        with pytest.raises(Refused, match="use --grpc-client-ping-interval-s and --grpc-pings-without-calls"):
            translated(["serve", f"{flag}=0"], _refuse)


TRITON_FLAGS = (  # every flag of tritonserver 2.73 (src/command_line_parser.cc), --help aside
    "--allow-client-shm",
    "--allow-cpu-metrics",
    "--allow-gpu-metrics",
    "--allow-grpc",
    "--allow-http",
    "--allow-metrics",
    "--allow-sagemaker",
    "--allow-vertex-ai",
    "--backend-config",
    "--backend-directory",
    "--buffer-manager-thread-count",
    "--cache-config",
    "--cache-directory",
    "--cuda-memory-pool-byte-size",
    "--cuda-virtual-address-size",
    "--disable-auto-complete-config",
    "--enable-peer-access",
    "--exit-on-error",
    "--exit-timeout-secs",
    "--grpc-address",
    "--grpc-header-forward-pattern",
    "--grpc-http2-max-ping-strikes",
    "--grpc-http2-max-pings-without-data",
    "--grpc-http2-min-recv-ping-interval-without-data",
    "--grpc-infer-allocation-pool-size",
    "--grpc-infer-response-compression-level",
    "--grpc-infer-thread-count",
    "--grpc-keepalive-permit-without-calls",
    "--grpc-keepalive-time",
    "--grpc-keepalive-timeout",
    "--grpc-max-connection-age",
    "--grpc-max-connection-age-grace",
    "--grpc-max-response-pool-size",
    "--grpc-port",
    "--grpc-restricted-protocol",
    "--grpc-root-cert",
    "--grpc-server-cert",
    "--grpc-server-key",
    "--grpc-use-ssl",
    "--grpc-use-ssl-mutual",
    "--host-policy",
    "--http-address",
    "--http-header-forward-pattern",
    "--http-max-input-size",
    "--http-port",
    "--http-restricted-api",
    "--http-thread-count",
    "--id",
    "--load-model",
    "--log-error",
    "--log-file",
    "--log-format",
    "--log-info",
    "--log-verbose",
    "--log-warning",
    "--metrics-address",
    "--metrics-config",
    "--metrics-interval-ms",
    "--metrics-port",
    "--min-supported-compute-capability",
    "--model-config-name",
    "--model-control-mode",
    "--model-load-gpu-limit",
    "--model-load-retry-count",
    "--model-load-thread-count",
    "--model-namespacing",
    "--model-repository",
    "--model-store",
    "--pinned-memory-pool-byte-size",
    "--rate-limit",
    "--rate-limit-resource",
    "--repoagent-directory",
    "--repository-poll-secs",
    "--response-cache-byte-size",
    "--reuse-grpc-port",
    "--reuse-http-port",
    "--sagemaker-port",
    "--sagemaker-safe-port-range",
    "--sagemaker-thread-count",
    "--strict-model-config",
    "--strict-readiness",
    "--trace-config",
    "--trace-count",
    "--trace-file",
    "--trace-level",
    "--trace-log-frequency",
    "--trace-rate",
    "--vertex-ai-default-model",
    "--vertex-ai-port",
    "--vertex-ai-thread-count",
)


def test_every_triton_flag_is_ours_or_answered_in_one_line() -> None:
    """No Triton flag meets argparse's bare "unrecognized arguments": each is ours, translated,
    or refused with a line that names what to use here."""
    ours = set(build_parser({}).parse_args(["serve"]).__dict__)
    unknown = [flag for flag in TRITON_FLAGS if triton_flag(flag) is None and flag[2:].replace("-", "_") not in ours]
    assert not unknown


@pytest.mark.parametrize("flag", sorted(OFF_HERE))
def test_what_is_off_here_is_accepted_off_and_refused_on(flag: str) -> None:
    assert translated(["serve", f"{flag}=false"], _refuse) == ["serve"]
    with pytest.raises(Refused, match=rf"^{flag}=true is Triton's: "):
        translated(["serve", f"{flag}=true"], _refuse)


def test_tritons_port_reuse_is_ours_for_every_port() -> None:
    for flag in ("--reuse-grpc-port", "--reuse-http-port"):
        translation = translated(["serve", f"{flag}=true"], _refuse)
        assert translation[1:] == ["--reuse-port", "true"]
        assert settings_from_namespace(build_parser({}).parse_args(translation), "INFO").reuse_port
