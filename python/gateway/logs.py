"""Structured logs: one JSON object per line (`--log-format json`) or readable text.

Records carry their data in `extra={"fields": {...}}`. Every handler redacts what it is given
(`gateway.redact`): known secrets and credential-shaped text never reach the output.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

from gateway.redact import RedactingFilter

__all__ = ["setup_logging"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        exc = _exc_text(self, record)
        if exc:
            out["exc"] = exc
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", None)
        tail = ""
        if isinstance(fields, dict):
            tail = " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        text = f"{stamp} {record.levelname.lower():5} {record.name}: {record.getMessage()}{tail}"
        exc = _exc_text(self, record)
        if exc:
            text += "\n" + exc
        return text


def _exc_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback: already rendered (and redacted) by `RedactingFilter`."""
    if record.exc_text:
        return record.exc_text
    if record.exc_info:
        return formatter.formatException(record.exc_info)
    return None


def setup_logging(fmt: str = "text", level: str = "info", access: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    # SPEC §7: no key in any log line, whoever logs it (aiohttp's tracebacks included).
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("gateway.access").setLevel(logging.INFO if access else logging.WARNING)
    # aiohttp's own access log duplicates ours.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
