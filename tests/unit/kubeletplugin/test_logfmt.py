"""Structured log formatting: JSON lines and text lines carrying ``extra`` context and exceptions."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from driver.kubeletplugin.logfmt import JsonFormatter, TextFormatter, configure_logging


@pytest.fixture
def stream() -> io.StringIO:
    return io.StringIO()


def _logger(name: str, stream: io.StringIO, formatter: logging.Formatter) -> Iterator[logging.Logger]:
    log = logging.getLogger(name)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        yield log
    finally:
        log.removeHandler(handler)
        log.propagate = True


@pytest.fixture
def json_log(stream: io.StringIO) -> Iterator[logging.Logger]:
    yield from _logger("tessera.test.json", stream, JsonFormatter())


@pytest.fixture
def text_log(stream: io.StringIO) -> Iterator[logging.Logger]:
    yield from _logger("tessera.test.text", stream, TextFormatter())


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_line_has_the_standard_fields(json_log: logging.Logger, stream: io.StringIO) -> None:
    json_log.warning("device %s is busy", "gpu-0")
    [line] = _lines(stream)
    record = json.loads(line)
    assert record["msg"] == "device gpu-0 is busy"
    assert record["level"] == "warning"
    assert record["logger"] == "tessera.test.json"
    assert datetime.fromisoformat(record["ts"]).utcoffset() is not None


def test_json_line_carries_extra_fields(json_log: logging.Logger, stream: io.StringIO) -> None:
    json_log.info("prepared", extra={"claim_uid": "uid-1", "devices": ["gpu-0", "gpu-2"], "count": 2})
    record = json.loads(_lines(stream)[0])
    assert record["claim_uid"] == "uid-1"
    assert record["devices"] == ["gpu-0", "gpu-2"]
    assert record["count"] == 2


def test_json_line_has_no_logging_internals(json_log: logging.Logger, stream: io.StringIO) -> None:
    json_log.info("plain")
    record = json.loads(_lines(stream)[0])
    assert set(record) == {"ts", "level", "logger", "msg"}


def test_json_line_turns_unserialisable_values_into_strings(json_log: logging.Logger, stream: io.StringIO) -> None:
    json_log.info("path", extra={"cdi_spec": Path("/var/run/cdi/x.json"), "ids": {1, 2} - {2}})
    record = json.loads(_lines(stream)[0])
    assert record["cdi_spec"] == "/var/run/cdi/x.json"
    assert record["ids"] == "{1}"


def test_json_line_carries_the_exception(json_log: logging.Logger, stream: io.StringIO) -> None:
    try:
        raise ValueError("bad allocation")
    except ValueError:
        json_log.exception("prepare failed", extra={"claim_uid": "uid-2"})
    lines = _lines(stream)
    assert len(lines) == 1, "a traceback must not break the one-object-per-line format"
    record = json.loads(lines[0])
    assert record["level"] == "error"
    assert record["claim_uid"] == "uid-2"
    assert "Traceback" in record["error"]
    assert "ValueError: bad allocation" in record["error"]


def test_text_line_reads_as_level_logger_message_and_fields(text_log: logging.Logger, stream: io.StringIO) -> None:
    text_log.info("prepared", extra={"claim_uid": "uid-1", "count": 2})
    [line] = _lines(stream)
    ts, rest = line.split(" ", 1)
    datetime.fromisoformat(ts)
    assert rest.startswith("INFO    tessera.test.text: prepared ")
    assert 'claim_uid="uid-1"' in line
    assert "count=2" in line


def test_text_line_without_fields_has_no_trailing_space(text_log: logging.Logger, stream: io.StringIO) -> None:
    text_log.error("plain")
    [line] = _lines(stream)
    assert line.endswith("ERROR   tessera.test.text: plain")


def test_text_format_puts_the_traceback_after_the_line(text_log: logging.Logger, stream: io.StringIO) -> None:
    try:
        raise RuntimeError("daemon gone")
    except RuntimeError:
        text_log.exception("restart failed", extra={"daemon_id": "plan-1"})
    lines = _lines(stream)
    assert "restart failed" in lines[0] and 'daemon_id="plan-1"' in lines[0]
    assert lines[1].startswith("Traceback")
    assert lines[-1] == "RuntimeError: daemon gone"


@pytest.mark.parametrize(("fmt", "formatter"), [("json", JsonFormatter), ("text", TextFormatter)])
def test_configure_logging_installs_one_handler(restore_root_logger: logging.Logger, fmt: str,
                                               formatter: type[logging.Formatter]) -> None:
    configure_logging("warning", fmt)
    assert len(restore_root_logger.handlers) == 1
    assert isinstance(restore_root_logger.handlers[0].formatter, formatter)
    assert restore_root_logger.level == logging.WARNING
    configure_logging("debug", fmt)  # calling again replaces, never stacks handlers
    assert len(restore_root_logger.handlers) == 1
    assert restore_root_logger.level == logging.DEBUG
