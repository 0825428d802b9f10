"""Structured log lines: one JSON object (or logfmt line) per record, carrying context fields.

Context is passed with ``extra=``; every non-standard LogRecord attribute becomes a field, so
``log.info("prepared", extra={"claim_uid": uid})`` yields ``{"msg": "prepared", "claim_uid": ...}``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    fields: dict[str, object] = {
        "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in vars(record).items():
        if key not in _STANDARD_ATTRS and not key.startswith("_"):
            fields[key] = value
    if record.exc_info:
        fields["error"] = logging.Formatter().formatException(record.exc_info)
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


class TextFormatter(logging.Formatter):
    """Human-friendly: ``ts level logger: msg key=value ...``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        head = f"{fields.pop('ts')} {str(fields.pop('level')).upper():7} {fields.pop('logger')}: {fields.pop('msg')}"
        error = fields.pop("error", None)
        tail = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in fields.items())
        line = f"{head} {tail}" if tail else head
        return f"{line}\n{error}" if error else line


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Set up the root logger once, at process start (the CLI calls this)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
