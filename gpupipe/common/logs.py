"""Structured logs: one JSON object per line on stderr (or plain text for people).

Services log events with fields (`log.info("delivery failed", extra={"fields": {...}})`)
so log pipelines can filter on topic/partition/gpu without regexes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        for k, v in record.__dict__.items():
            if k not in _RESERVED and k != "fields":
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        base = f"{when} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record, not the one at setup.

    A thread that outlives a redirected stderr (pytest's capture, a daemon's reopened log) would
    otherwise write to a closed file and print "Logging error ... I/O operation on closed file".
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:  # the base class's attribute, looked up at each use
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:  # the base __init__ sets it: ignored
        pass


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def fields(**kw: Any) -> dict[str, Any]:
    """`extra=` payload for structured fields: log.info("x", extra=fields(topic=t))."""
    return {"fields": kw}
