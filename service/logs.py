"""Structured logs: one JSON object per line, with the request id of the call being served."""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import secrets
import sys
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


_ID_PREFIX = secrets.token_hex(4)  # per process: ids stay unique across workers and restarts
_ID_COUNTER = itertools.count(1)


def new_request_id(client_id: str = "") -> str:
    """The client's id where it sent one (tracing across systems), else a fresh one: this process's
    random prefix and a counter (a uuid4 per request cost more than the rest of the call scope)."""
    return client_id[:64] if client_id else f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id = request_id_var.get()
        record.request_tag = f" [{request_id}]" if request_id else ""  # text lines: nothing when there is none
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")
        if request_id:
            entry["request_id"] = request_id
        for key in ("method", "code", "duration_ms"):  # what the call scope's log lines carry
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, fmt: str) -> None:
    """`fmt` json, text, or auto: text for a person at a terminal, JSON for a log collector."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s%(request_tag)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("onnx_ir", "onnxscript"):  # the exporter's optimiser narrates every node at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" and such
