"""Structured logs: one JSON object per line, with the request id of the call being served."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import math
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from service.errors import KINDS, described

log = logging.getLogger(__name__)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


_ID_PREFIX = secrets.token_hex(4)  # per process: ids stay unique across workers and restarts
_ID_COUNTER = itertools.count(1)


def new_request_id(client_id: str = "") -> str:
    """The client's id where it sent one (tracing across systems), else a fresh one: this process's
    random prefix and a counter (a uuid4 per request cost more than the rest of the call scope)."""
    if not client_id:
        return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"
    cut = client_id[:64]  # a client's string in every log line of its call: cut, and one line of text
    return cut if cut.isprintable() else "".join(c if c.isprintable() else "?" for c in cut)


class RequestIdFilter(logging.Filter):
    """Each record's request id (of the call being served) and, among several workers, this
    process's worker index: the lines of one call, on every worker it crossed, share the id."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker
        self.worker_tag = "" if worker is None else f" worker {worker}"

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id = request_id_var.get()
        record.request_tag = f" [{request_id}]" if request_id else ""  # text lines: nothing when there is none
        record.worker = self.worker
        record.worker_tag = self.worker_tag
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        worker = getattr(record, "worker", None)
        if worker is not None:
            entry["worker"] = worker
        request_id = getattr(record, "request_id", "")
        if request_id:
            entry["request_id"] = request_id
        for key in ("method", "code", "duration_ms"):  # what the call scope's log lines carry
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


TEXT_FORMAT = "%(asctime)s %(levelname)s%(worker_tag)s %(name)s%(request_tag)s %(message)s"  # for a person


def configure_logging(level: str, fmt: str, worker: int | None = None) -> None:
    """`fmt` json, text, or auto: text for a person at a terminal, JSON for a log collector;
    `worker`: this process's index where several workers share one log."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter(worker))
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("onnx_ir", "onnxscript"):  # the exporter's optimiser narrates every node at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)


LogSetting = bool | int | str
UINT32_MAX = 2**32 - 1
LOG_SETTING_TYPES: dict[str, type] = {
    "log_file": str,
    "log_info": bool,
    "log_warning": bool,
    "log_error": bool,
    "log_verbose_level": int,
    "log_format": str,
}


def log_settings() -> dict[str, LogSetting]:
    """Triton's log settings, as this process logs now (its root logger's level)."""
    level = logging.getLogger().level
    return {
        "log_file": "",  # stderr: the container runtime keeps it
        "log_info": level <= logging.INFO,
        "log_warning": level <= logging.WARNING,
        "log_error": level <= logging.ERROR,
        "log_verbose_level": 1 if level <= logging.DEBUG else 0,
        "log_format": "default",
    }


def change_log_settings(changes: dict[str, LogSetting]) -> dict[str, LogSetting]:
    """Apply Triton's log settings `changes` (ValueError saying what is wrong, nothing changed);
    the settings after them. Levels nest here, as Python's do: verbose, then info, warning, error."""
    for key, value in changes.items():
        expected = LOG_SETTING_TYPES.get(key)
        if expected is None:
            raise ValueError(f"unknown log setting {key[:64]!r}; expected some of {', '.join(LOG_SETTING_TYPES)}")
        if type(value) is not expected:
            choices = " (true or false)" if expected is bool else ""
            raise ValueError(f"log setting {key} must be {KINDS[expected]}{choices}, got {described(value)}")
    verbose = changes.get("log_verbose_level", 0)
    if not 0 <= int(verbose) <= UINT32_MAX:  # gRPC's uint32_param carries it to Triton's clients and to workers
        raise ValueError(f"log_verbose_level must be 0 to {UINT32_MAX} (0: off, 1 or more: verbose), got {verbose}")
    if changes.get("log_file"):
        raise ValueError("log_file: this server logs to stderr only (the container runtime keeps it)")
    if changes.get("log_format", "default") != "default":
        raise ValueError("log_format: only 'default'; text or JSON lines are chosen at start (--log-format)")
    wanted = {**log_settings(), **changes}
    level = logging.CRITICAL + 10  # nothing
    for key, candidate in (("log_error", logging.ERROR), ("log_warning", logging.WARNING), ("log_info", logging.INFO)):
        if wanted[key]:  # the most verbose one on wins: info implies warning and error
            level = candidate
    if isinstance(wanted["log_verbose_level"], int) and wanted["log_verbose_level"] > 0:
        level = logging.DEBUG
    logging.getLogger().setLevel(level)
    return log_settings()


OUT_OF_RESOURCES = "socket.accept() out of system resource"  # asyncio's words, for EMFILE/ENFILE/ENOBUFS/ENOMEM


class AcceptFailures:
    """The event loop's exception handler: a listener that cannot accept for want of file
    descriptors (or memory) is said once per `every_s`, with a count, not once per attempt.
    asyncio logs each failed accept with its traceback and retries; held open by a flood of
    connections, that wrote 31,000 records (16 MB) in seconds. Every other context goes to the
    loop's default handler."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.failed = 0
        self.said_at = -math.inf

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != OUT_OF_RESOURCES:
            loop.default_exception_handler(context)
            return
        self.failed += 1
        if self.clock() - self.said_at >= self.every_s:
            self.said_at = self.clock()
            log.error(
                "cannot accept connections: %s (%d failed accepts since the last such line); new connections wait "
                "in the listen queue. Raise the open-file limit (ulimit -n, a container's nofile), or limit "
                "connections in front of the server",
                context.get("exception"),
                self.failed,
            )
            self.failed = 0
