"""Triton's operator flags on `mha serve`: the ones whose meaning is ours too are translated (as
aliases), the others are refused with one line that names what to use here. Its flags that are
ours already (--model-repository, --model-control-mode, --repository-poll-secs, --load-model,
--http-port, --grpc-port, --metrics-port) need nothing. docs/operations.md, "Coming from Triton",
has the same table for people."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

FALSE, TRUE = ("false", "0", "no", "off"), ("true", "1", "yes", "on")
Translation = tuple[list[str], list[str]]  # (global flags, serve flags) that take its place

RENAMED = {"--model-store": "--model-repository", "--exit-timeout-secs": "--grace-s"}
MILLISECONDS = {  # Triton's flag in milliseconds -> ours in seconds
    "--grpc-max-connection-age": "--grpc-max-connection-age-s",
    "--grpc-max-connection-age-grace": "--grpc-max-connection-age-grace-s",
    "--grpc-http2-min-recv-ping-interval-without-data": "--grpc-client-ping-interval-s",
    "--grpc-keepalive-time": "--grpc-keepalive-time-s",
    "--grpc-keepalive-timeout": "--grpc-keepalive-timeout-s",
}
BOOLEAN = {  # Triton's -> ours
    "--grpc-keepalive-permit-without-calls": "--grpc-pings-without-calls",
    "--reuse-grpc-port": "--reuse-port",  # one setting here, for every port
    "--reuse-http-port": "--reuse-port",
}
PINGS = "use --grpc-client-ping-interval-s and --grpc-pings-without-calls to allow pings; counts keep gRPC's defaults"
# Triton's flag -> (what its `false` means here, or the refusal when it has no meaning here)
SWITCHED: dict[str, tuple[list[str] | None, str]] = {
    "--allow-http": (["--http-port", "off"], ""),
    "--allow-metrics": (["--metrics-port", "off"], ""),
    "--allow-grpc": (None, "the gRPC port cannot be turned off here: it is the server's main API"),
    "--strict-readiness": (None, "readiness here is always strict: ready only while a version serves"),
    "--exit-on-error": (None, "startup errors here always stop the server (exit code 1 or 2)"),
}
OTHER_HTTP = "HTTP is KServe v2's here (--http-port): SageMaker's and Vertex AI's endpoints are not served"
# Triton's flag -> why its `true` is refused; its `false` is what happens here already
OFF_HERE = {
    "--allow-gpu-metrics": "GPU metrics are not exported here: use DCGM's exporter beside the pod",
    "--allow-cpu-metrics": "metrics of CPU and memory here are process_cpu_seconds_total and "
    "process_resident_memory_bytes, by worker, always on",
    "--allow-client-shm": "use --shared-memory system, cuda or system,cuda (off by default, as Triton's)",
    "--allow-sagemaker": OTHER_HTTP,
    "--allow-vertex-ai": OTHER_HTTP,
}
NO_CACHE = "there is no response cache here: every answer is computed; drop it"
TOKENS = "use --auth-token-file, and --admin-token-file for the control calls (repository, settings, regions)"
REFUSED = {
    "--backend-directory": "backends are built in: choose one with --backend (auto, ort-cuda, ort-cpu, torch)",
    "--backend-config": "use --backend, --threads, --precision and --gpu-mem-limit-mb",
    "--cuda-memory-pool-byte-size": "use --gpu-mem-limit-mb (ONNX Runtime's CUDA arena)",
    "--pinned-memory-pool-byte-size": "there is no pinned pool to size here; drop it",
    "--http-address": "use --host (every port binds it) and --metrics-host",
    "--grpc-address": "use --host (every port binds it) and --metrics-host",
    "--metrics-address": "use --metrics-host",
    "--http-thread-count": "HTTP is served on the event loop here; drop it",
    "--grpc-infer-allocation-pool-size": "there is no allocation pool to size here; drop it",
    "--grpc-use-ssl": "use --tls-cert and --tls-key (and --tls-client-ca for mTLS)",
    "--grpc-server-cert": "use --tls-cert",
    "--grpc-server-key": "use --tls-key",
    "--grpc-root-cert": "use --tls-client-ca",
    "--trace-config": "use --otlp-endpoint and OTEL_TRACES_SAMPLER(_ARG) (docs/operations.md#tracing)",
    "--trace-file": "traces go to an OTLP collector: use --otlp-endpoint",
    "--trace-level": "use --otlp-endpoint and OTEL_TRACES_SAMPLER (docs/operations.md#tracing)",
    "--trace-rate": "use OTEL_TRACES_SAMPLER=traceidratio and OTEL_TRACES_SAMPLER_ARG",
    "--id": "use --replica-name",
    "--strict-model-config": "the config is generated from the model directory; drop it",
    "--disable-auto-complete-config": "the config is generated from the model directory; drop it",
    "--metrics-interval-ms": "metrics are read at each scrape; drop it",
    "--rate-limit": "use --max-queue-size and --max-inflight-mb",
    "--model-load-thread-count": "versions load one at a time, beside the one serving; drop it",
    "--grpc-http2-max-pings-without-data": PINGS,
    "--grpc-http2-max-ping-strikes": PINGS,
    "--grpc-use-ssl-mutual": "use --tls-client-ca (mTLS), with --tls-cert and --tls-key",
    "--grpc-restricted-protocol": TOKENS,
    "--http-restricted-api": TOKENS,
    "--grpc-infer-thread-count": "gRPC is served on each worker's event loop here: use --workers",
    "--grpc-max-response-pool-size": "there is no response pool to size here; drop it",
    "--grpc-infer-response-compression-level": "answers are sent uncompressed here; drop it",
    "--grpc-header-forward-pattern": "there is no header forwarding here: a request's parameters carry it; drop it",
    "--http-header-forward-pattern": "there is no header forwarding here: a request's parameters carry it; drop it",
    "--http-max-input-size": "use --max-message-mb (MiB; it bounds HTTP bodies and gRPC messages alike)",
    "--log-file": "logs go to stderr here (JSON with --log-format json), for the container runtime to keep",
    "--buffer-manager-thread-count": "there is no buffer manager to size here; drop it",
    "--cache-config": NO_CACHE,
    "--cache-directory": NO_CACHE,
    "--response-cache-byte-size": NO_CACHE,
    "--cuda-virtual-address-size": "use --gpu-mem-limit-mb (ONNX Runtime's CUDA arena)",
    "--model-load-gpu-limit": "use --gpu-mem-limit-mb (ONNX Runtime's CUDA arena)",
    "--enable-peer-access": "there is no peer access to set: each worker computes on one GPU; drop it",
    "--min-supported-compute-capability": "backends are self-checked on their device at start (docs/gpu.md); drop it",
    "--host-policy": "use the container's CPU set and --threads",
    "--metrics-config": "metrics have fixed latency buckets here (100 us to 10 s) and no summaries; drop it",
    "--model-config-name": "the config is generated from the model directory; drop it",
    "--model-load-retry-count": "there is no load retry to set here; drop it",
    "--model-namespacing": "there is one model per server here; drop it",
    "--rate-limit-resource": "use --max-queue-size and --max-inflight-mb",
    "--repoagent-directory": "there are no repository agents here; drop it",
    "--trace-count": "use OTEL_TRACES_SAMPLER (docs/operations.md#tracing)",
    "--trace-log-frequency": "traces go to an OTLP collector: use --otlp-endpoint",
    **{flag: OTHER_HTTP for flag in ("--sagemaker-port", "--sagemaker-safe-port-range", "--sagemaker-thread-count")},
    **{flag: OTHER_HTTP for flag in ("--vertex-ai-port", "--vertex-ai-thread-count", "--vertex-ai-default-model")},
}
LOG_LEVELS = {"--log-info": "INFO", "--log-warning": "WARNING", "--log-error": "ERROR"}


def _one(flag: str, value: str, refuse: Callable[[str], NoReturn]) -> Translation:
    """What Triton's `flag value` becomes here: ([global flags], [serve flags])."""
    if flag in RENAMED:
        return [], [RENAMED[flag], value]
    if flag in MILLISECONDS:
        if not value.strip().isascii() or not value.strip().isdigit():
            refuse(f"{flag} {value[:32]!r}: expected whole milliseconds (Triton's flag)")
        return [], [MILLISECONDS[flag], str(int(value) / 1000)]
    if flag in REFUSED:
        refuse(f"{flag} is Triton's: {REFUSED[flag]}")
    if flag in BOOLEAN and value.lower() in FALSE + TRUE:
        return [], [BOOLEAN[flag], "true" if value.lower() in TRUE else "false"]
    if flag == "--log-verbose":
        return (["--log-level", "DEBUG"] if value.strip() not in ("", "0") else []), []
    if flag in LOG_LEVELS:
        if value.lower() in TRUE:
            return [], []
        refuse(f"{flag} is Triton's: set the level instead, e.g. `mha --log-level WARNING serve`")
    if value.lower() not in FALSE + TRUE:
        refuse(f"{flag} {value[:32]!r}: expected true or false (Triton's flag)")
    if flag in OFF_HERE:
        if value.lower() in TRUE:
            refuse(f"{flag}={value} is Triton's: {OFF_HERE[flag]}")
        return [], []
    off, why = SWITCHED[flag]
    if value.lower() in TRUE:
        return [], []
    if off is None:
        refuse(f"{flag}={value} is Triton's: {why}")
    return [], off or []


def triton_flag(arg: str) -> str | None:
    name = arg.split("=", 1)[0]
    tables = (RENAMED, MILLISECONDS, REFUSED, SWITCHED, OFF_HERE, LOG_LEVELS, BOOLEAN)
    return name if name == "--log-verbose" or any(name in table for table in tables) else None


def translated(argv: Sequence[str], refuse: Callable[[str], NoReturn]) -> list[str]:
    """`argv` with Triton's flags after `serve` translated; `refuse(message)` must not return."""
    args = list(argv)
    if "serve" not in args:
        return args
    start = args.index("serve") + 1
    before, rest, after = args[: start - 1], args[start:], []
    i = 0
    while i < len(rest):
        flag = triton_flag(rest[i])
        if flag is None:
            after.append(rest[i])
            i += 1
            continue
        if "=" in rest[i]:
            value, i = rest[i].split("=", 1)[1], i + 1
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value, i = rest[i + 1], i + 2
        else:
            refuse(f"{flag} needs a value, as Triton's does (e.g. {flag}=false)")
        own, serve = _one(flag, value, refuse)
        before, after = [*before, *own], [*after, *serve]
    return [*before, "serve", *after]
