"""One settings object for `mha serve`, built in main() from flags and MHA_* variables.

Each setting is declared once, below: type, default, unit, help, bounds or choices. From that
declaration come the flag `--some-setting`, the variable `MHA_SOME_SETTING` (a flag on the
command line wins) and the checks, which run whenever a Settings is made.
"""

from __future__ import annotations

import argparse
import math
import re
import socket
import types
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from export.layout import MANIFEST_FILE
from service.resources import available_cpus
from service.scheduling import SchedulePolicy, parse_queue_policies

BACKEND_CHOICES = ("auto", "ort-cuda", "ort-cpu", "torch")
LOG_FORMATS = ("auto", "json", "text")
SHARED_MEMORY_CHOICES = ("off", "system", "cuda", "system,cuda")
DEVICE_CHOICES = ("any", "cuda")
PRECISION_CHOICES = ("fp32", "fp16", "bf16")
MODEL_CONTROL_MODES = ("none", "poll", "explicit")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
OFF = "off"  # a port that is not opened
GRPC_S: dict[str, Any] = {"unit": "s", "low": 0, "high": (2**31 - 1) / 1000}  # gRPC takes C ints of ms


def setting(
    default: Any,
    help: str,
    unit: str = "",
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] | None = None,
    flag: bool = True,
) -> Any:
    """A Settings field: `low`/`high` are inclusive bounds; `flag=False` keeps it off `mha serve`'s flags."""
    meta = {"help": help, "unit": unit, "low": low, "high": high, "choices": choices, "flag": flag}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class NetworkSettings:
    """How the server meets its clients: addresses and ports, TLS and tokens, the gRPC and HTTP
    transports. Settings holds these too; they are apart to keep each class short."""

    host: str = setting("0.0.0.0", "address to bind")
    grpc_port: int = setting(8001, "gRPC port; 0 picks a free one", low=0, high=65535)
    http_port: int | None = setting(8000, "HTTP/REST port (KServe v2); 0 picks one; off: none", low=0, high=65535)
    metrics_port: int | None = setting(8002, "Prometheus /metrics port; 0 picks one; off: none", low=0, high=65535)
    metrics_host: str | None = setting(None, "address the /metrics port binds; unset: the same as --host")
    metrics_unloaded_s: float = setting(
        300.0, "how long /metrics keeps the series of a model version after it unloads; 0: not at all", "s", low=0
    )
    health_port: int | None = setting(
        None, "plaintext port of the gRPC health service alone, for probes under mTLS; 0 picks one", low=0, high=65535
    )
    http_write_timeout_s: float = setting(
        60.0, "how long an HTTP client may take to read its answer before its connection is closed", "s", low=0.001
    )
    http_read_timeout_s: float = setting(
        60.0, "an HTTP request's body must arrive whole within this, once its head has; else 408", "s", low=0.001
    )
    http_max_connection_age_s: float = setting(0.0, "close keep-alive HTTP connections this old; 0: never", "s", low=0)
    stream_window: int = setting(
        32, "requests a gRPC stream may have read and not had written back; past it, it is not read", "requests", low=1
    )
    max_message_mb: int = setting(  # gRPC counts a message's bytes in a 32-bit int
        64, "gRPC message size, each way, before RESOURCE_EXHAUSTED", "MiB", low=1, high=2047
    )
    grpc_max_connection_age_s: float = setting(0.0, "GOAWAY to a gRPC connection this old; 0: never", **GRPC_S)
    grpc_max_connection_age_grace_s: float = setting(0.0, "calls may last this long after GOAWAY; 0: no cap", **GRPC_S)
    grpc_client_ping_interval_s: float = setting(0.0, "least gap between a client's pings; 0: 5 min", **GRPC_S)
    grpc_keepalive_time_s: float = setting(0.0, "ping a connection silent this long; 0: 2 h", **GRPC_S)
    grpc_keepalive_timeout_s: float = setting(0.0, "close a connection not answering a ping by then; 0: 60 s", **GRPC_S)
    grpc_pings_without_calls: bool = setting(False, "keepalive pings, clients' and ours, while no call is in flight")
    tls_cert: Path | None = setting(None, "PEM server certificate; with --tls-key, serve TLS")
    tls_key: Path | None = setting(None, "PEM private key of --tls-cert")
    tls_client_ca: Path | None = setting(None, "PEM CA bundle; clients must present a certificate it signed (mTLS)")
    auth_token_file: Path | None = setting(None, "file of the bearer tokens clients may send, one a line")
    admin_token_file: Path | None = setting(
        None, "file holding the token control calls need: repository, settings, regions"
    )

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together; give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if self.grpc_max_connection_age_grace_s > 0 and self.grpc_max_connection_age_s == 0:
            raise ValueError("--grpc-max-connection-age-grace-s is a grace after --grpc-max-connection-age-s: set both")


@dataclass(frozen=True)
class Settings(NetworkSettings):
    model_dir: Path | None = setting(None, "model directory from `mha export`; unset: the default model")
    default_model_dir: Path | None = setting(
        None,
        "where the default model is kept, exported there first if missing; unset: ./models/default in a "
        "checkout of mha-serve, else $XDG_CACHE_HOME/mha-serve/models/default (~/.cache/...)",
    )
    model_repository: Path | None = setting(
        None, "Triton's model repository: DIR/<model-name>/<version>/, each version as `mha export` writes it"
    )
    model_control_mode: str = setting(
        "none",
        "none: serve the repository's versions found at start; poll: follow it (--repository-poll-secs); "
        "explicit: load and unload on request (--load-model, the repository API)",
        choices=MODEL_CONTROL_MODES,
    )
    repository_poll_secs: float = setting(15.0, "how often poll mode reads the repository again", "s", low=0.1)
    load_model: str = setting("", "explicit mode: the model to load at start (its name, or *); empty: none")
    model_name: str = setting("mha", "model name clients address")
    model_version: str = setting("1", "model version clients may address")
    sequence_model_name: str = setting(
        "", "the model's entry for sequences (sequence batching: each request a step); empty: <model-name>_sequence"
    )
    otlp_endpoint: str | None = setting(
        None,
        "OTLP/HTTP collector for traces, e.g. http://otel-collector:4318; unset: the OTEL_EXPORTER_OTLP_* "
        "variables, or no tracing (docs/operations.md#tracing)",
    )
    backend: str = setting("auto", "backend; auto measures and falls back", choices=BACKEND_CHOICES)
    precision: str = setting(
        "fp32", "compute precision: fp16/bf16 serve model.<precision>.onnx (fp32 in and out)", choices=PRECISION_CHOICES
    )
    gpu_mem_limit_mb: int = setting(0, "cap on ORT's CUDA arena (gpu_mem_limit); 0: no cap", "MiB", low=0)
    require_device: str = setting(
        "any", "cuda: ready only while a CUDA backend serves (no silent CPU fallback)", choices=DEVICE_CHOICES
    )
    workers: str = setting("auto", "server processes sharing the ports; auto: one per GPU, else one per CPU")
    worker_watchdog_s: float = setting(
        30.0,
        "a worker whose event loop answers nothing this long is taken for hung and replaced",
        "s",
        low=2,
        high=3600,
    )
    reuse_port: bool = setting(False, "share the ports with other processes (what each of --workers does)")
    replica_name: str = setting("", "this replica's name in step responses and messages; empty: the host name")
    worker_index: int = setting(0, "this process's index among --workers (set by the supervisor)", low=0)
    worker_peers: int = setting(1, "workers sharing the ports, this one included (set by the supervisor)", low=1)
    worker_socket_dir: Path | None = setting(None, "directory of the workers' Unix sockets (set by the supervisor)")
    worker_bind_first: bool = setting(False, "bind before loading, NOT_SERVING meanwhile (set by the supervisor)")
    worker_own_gpu: bool = setting(False, "this worker's GPU is its own, not the workers' (set by the supervisor)")
    worker_metrics_fd: int | None = setting(
        None, "an inherited socket, bound, on which this worker serves its own /metrics (set by the supervisor)", low=0
    )
    worker_wait_fd: int | None = setting(
        None, "an inherited pipe: load the model once its other end closes (set by the supervisor)", low=0
    )
    parent_pid: int | None = setting(
        None, "end when process PID, which started this one, ends (set by the supervisor and by mha tune)", low=1
    )
    threads: int = setting(
        0, "intra-op threads of the CPU backends; 0: the CPUs this process may use (affinity, cgroup CPU limit)", low=0
    )
    thread_spinning: bool = setting(False, "let idle intra-op threads busy-wait: a little latency for a lot of CPU")
    max_batch_size: int = setting(8, "rows per executed batch; 1 turns batching off", "rows", low=1)
    max_queue_delay_ms: float = setting(2.0, "how long the first request of a batch waits for company", "ms", low=0)
    max_queue_size: int = setting(256, "requests waiting before RESOURCE_EXHAUSTED", "requests", low=1)
    priority_levels: int = setting(1, "Triton's priority levels (1 the highest) of the stateless model", low=1)
    default_priority_level: int = setting(1, "the level of a request that sends no priority (or 0)", low=1)
    queue_policy: str = setting("", "Triton's queue policies: [LEVEL:]key=value,...;... (docs/operations.md)")
    max_priority_overtakes: int = setting(16, "batches that may pass a waiting request; 0: strict priority", low=0)
    max_inflight_mb: float = setting(
        0.0,
        "requests and answers held at once before RESOURCE_EXHAUSTED; 0: a quarter of the memory limit",
        "MiB",
        low=0,
    )
    require_sequence_offset: bool = setting(
        False, "refuse a step without sequence_offset (FAILED_PRECONDITION): on where several replicas serve"
    )
    max_padding_ratio: float = setting(0.25, "padded share of a batch's tokens when merging T", low=0, high=1)
    max_request_rows: int = setting(256, "largest B in one request", "rows", low=1)
    max_sequences: int = setting(256, "live sequences (incremental decoding) kept at most", "sequences", low=1)
    max_step_rows: int = setting(64, "rows of decode steps computed together (usually a token each)", "rows", low=1)
    sequence_idle_timeout_s: float = setting(60.0, "a live sequence idle this long is evicted", "s", low=0)
    max_sequence_state_mb: float = setting(1024.0, "keys and values of live sequences at most", "MiB", low=0)
    shared_memory: str = setting(
        "off", "Triton's shared memory extensions (system, cuda), for same-host clients", choices=SHARED_MEMORY_CHOICES
    )
    max_shared_memory_regions: int = setting(64, "registered shared memory regions at most", "regions", low=1)
    max_attention_mb: float = setting(
        1024.0, "attention memory (B x heads x T x T x 4 bytes) per request and per batch", "MiB", low=1
    )
    grace_s: float = setting(20.0, "time in-flight requests get to finish on SIGTERM", "s", low=0)
    fallback_failures: int = setting(3, "consecutive failures that quarantine a backend", low=1)
    fallback_cooldown_s: float = setting(30.0, "time a quarantined backend waits before its probe", "s", low=0)
    allow_unverified: bool = setting(False, "serve files manifest.json does not vouch for (logged as an error)")
    audit_rate: float = setting(0.001, "share of answers and steps recomputed in float64; 1: all", low=0, high=1)
    audit_max_cpu: float = setting(0.05, "share of one CPU the audit may take, on average", low=0.001, high=1)
    audit_queue: int = setting(64, "answers waiting for their audit at most; beyond: skipped", "answers", low=1)
    audit_max_tokens: int = setting(256, "tokens of one row an audit checks (windows in turn)", "tokens", low=1)
    audit_when_busy: bool = setting(False, "audit even while a full batch waits (off: saturated servers skip)")
    audit_before_answer: bool = setting(False, "check every token of every answer before sending it; refuse if wrong")
    log_format: str = setting("auto", "log lines: text on a terminal, JSON otherwise (auto)", choices=LOG_FORMATS)
    log_level: str = setting("INFO", "log level", choices=LOG_LEVELS, flag=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f, getattr(self, f.name))
        super().__post_init__()
        if self.workers != "auto" and not re.fullmatch(r"0*[1-9][0-9]*", self.workers):  # ASCII: int() fails on '²'
            raise ValueError(f"--workers {self.workers!r}: expected a positive number or auto")
        if self.model_repository is not None and self.model_dir is not None:
            raise ValueError("--model-repository and --model-dir are two sources of versions; give one")
        if self.model_control_mode != "none" and self.model_repository is None:
            raise ValueError(
                f"--model-control-mode {self.model_control_mode} follows a repository: give --model-repository "
                "(--model-dir is a repository of one version, served as it is)"
            )
        if self.load_model not in ("", "*", self.model_name):
            raise ValueError(f"--load-model {self.load_model[:64]!r}: this server serves {self.model_name!r} (or *)")
        if self.load_model and self.model_control_mode != "explicit":
            raise ValueError("--load-model is for --model-control-mode explicit (the other modes load at start)")
        schedule_policy(self)  # its checks: the levels and --queue-policy
        _check_names(self.model_name, self.sequence_model_name)

    @property
    def replica(self) -> str:
        """This replica's name: --replica-name, else the host name (a pod's name in Kubernetes)."""
        return self.replica_name or socket.gethostname()

    @property
    def cpus(self) -> int:
        """The CPUs this process may use (its affinity, its cgroup's limit), whatever --threads says."""
        return available_cpus()

    @property
    def cpu_threads(self) -> int:
        return self.threads if self.threads > 0 else self.cpus


def schedule_policy(s: Settings) -> SchedulePolicy:
    """The stateless model's schedule policy, from --priority-levels, --default-priority-level,
    --queue-policy and --max-priority-overtakes."""
    try:
        default, levels = parse_queue_policies(s.queue_policy)
        return SchedulePolicy(s.priority_levels, s.default_priority_level, default, levels, s.max_priority_overtakes)
    except ValueError as exc:
        raise ValueError(f"--priority-levels/--queue-policy: {exc}") from None


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _check(f: Field[Any], value: Any) -> None:
    meta = f.metadata
    if value is None:  # unset, or a port turned off
        return
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"{_flag(f.name)} {value!r}: expected one of {', '.join(meta['choices'])}")
    if isinstance(value, float) and not math.isfinite(value):  # nan and inf parse as floats, and pass bounds
        raise ValueError(f"{_flag(f.name)} must be a finite number, got {value}")
    if meta["low"] is not None and value < meta["low"]:
        raise ValueError(f"{_flag(f.name)} must be >= {meta['low']:g}, got {value}")
    if meta["high"] is not None and value > meta["high"]:
        raise ValueError(f"{_flag(f.name)} must be <= {meta['high']:g}, got {value}")


def _check_names(model: str, sequence: str) -> None:
    """The names clients address: a path segment each (HTTP routes hold them), and two of them."""
    for flag, name in (("--model-name", model), ("--sequence-model-name", sequence)):
        if "/" in name or (flag == "--model-name" and not name.strip()):
            raise ValueError(f"{flag} {name[:64]!r}: expected a name without '/', as a Triton model's folder")
    if sequence == model:
        raise ValueError(
            f"--sequence-model-name {sequence[:64]!r} is the --model-name too: the sequence entry needs a name of "
            f"its own (empty: {model[:64]}_sequence)"
        )


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _port(text: str) -> int | None:
    """A port number, 0 (pick a free one) or off."""
    if text.strip().lower() == OFF:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a port number, 0 (pick a free one) or {OFF}, got {text!r}"
        ) from None


def _parser_type(annotation: Any) -> Any:
    """int, float, str, Path or a strict boolean, from the field's type (`Path | None` -> Path);
    `int | None` is a port that can be turned off."""
    if isinstance(annotation, types.UnionType):
        if set(annotation.__args__) == {int, type(None)}:
            return _port
        annotation = next(a for a in annotation.__args__ if a is not type(None))
    return _boolean if annotation is bool else annotation


def default_model_home(cwd: Path, environ: Mapping[str, str]) -> Path:
    """Where the default model lives when --default-model-dir is unset: ./models/default in a
    checkout of mha-serve (or wherever one was exported before), else the user's cache directory,
    so that `mha serve` run elsewhere neither litters the working directory nor exports again."""
    local = cwd / "models" / "default"
    if (local / MANIFEST_FILE).is_file() or ((cwd / "pyproject.toml").is_file() and (cwd / "service").is_dir()):
        return local
    cache = Path(environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME") or Path.home()) / ".cache")
    return cache / "mha-serve" / "models" / "default"


def add_serve_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """One flag per Settings field, defaulting to MHA_<NAME> where set (argparse parses it too);
    the network's flags listed after the others, under a heading of their own."""
    hints = get_type_hints(Settings)
    network = {f.name for f in fields(NetworkSettings)}
    heading = "addresses and ports, TLS and tokens, the gRPC and HTTP transports"
    groups = {False: parser, True: parser.add_argument_group("network", heading)}
    for f in sorted(fields(Settings), key=lambda f: f.name in network):  # stable: declared order in each
        if not f.metadata["flag"]:
            continue
        env = f"MHA_{f.name.upper()}"
        unit = f" ({f.metadata['unit']})" if f.metadata["unit"] else ""
        kind = _parser_type(hints[f.name])
        flag_kind: dict[str, Any] = {"nargs": "?", "const": True} if kind is _boolean else {}  # `--flag` alone: on
        if any("," in choice for choice in f.metadata["choices"] or ()):  # argparse would list `system,cuda` as two
            flag_kind["metavar"] = "{" + "|".join(f.metadata["choices"]) + "}"
        groups[f.name in network].add_argument(
            _flag(f.name),
            dest=f.name,
            type=kind,
            choices=f.metadata["choices"],
            default=environ.get(env, f.default),
            help=f"{f.metadata['help']}{unit} [env {env}]",
            **flag_kind,
        )


def to_argv(settings: Settings) -> list[str]:
    """`mha serve` flags that rebuild `settings` (those that differ from the defaults)."""
    argv: list[str] = []
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if f.metadata["flag"] and value != f.default:
            text = OFF if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            argv += [_flag(f.name), text]
    return argv


def settings_from_namespace(ns: argparse.Namespace, log_level: str) -> Settings:
    """Settings from parsed flags; raises ValueError with the flag's name when a value is out of bounds."""
    values = {f.name: getattr(ns, f.name) for f in fields(Settings) if f.metadata["flag"]}
    return Settings(**values, log_level=log_level.upper())
