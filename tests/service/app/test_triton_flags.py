"""Triton's operator flags on `mha serve`: aliases where the meaning is ours, one line naming our
equivalent where it is not (the misuse table in test_cli_misuse.py runs them end to end)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.app.triton_flags import REFUSED, translated
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
    equivalent = "(use|backends|there|HTTP|traces|the config|metrics|versions)"
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
