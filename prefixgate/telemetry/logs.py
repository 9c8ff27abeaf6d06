"""Log output of prefixgate processes: text for people, JSON lines for log pipelines.

`configure(level, fmt)` sets the root logger's one prefixgate handler (idempotent: a second
call replaces it; handlers others installed, such as pytest's, stay). The handler looks
sys.stderr up at each record, never binding the stream of the moment: a command run
in-process (tests call `prefixgate.cli.main`) must not leave a handler writing to a
stream its caller has since closed. Structured records carry
their fields in `extra={"fields": {...}, "event": "..."}` (e.g. the gateway's one line per
turn, gateway/metrics.py) and say them as key=value in their text; the JSON format
(`--log-format json`) writes one object per line with ts, level, logger, message (the
event) and the fields as top-level keys, through python-json-logger (the maintained
JSON formatter for the logging package) rather than a formatter of our own.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

FORMATS = ("text", "json")


class JsonFormatter(_LibraryJsonFormatter):
    """python-json-logger's JSON formatter (serialisation of any value, exceptions, extra
    record attributes) with prefixgate's keys: ts (ISO 8601, UTC), level, logger, message
    (a structured record's event), and a structured record's fields as top-level keys."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s %(message)s", timestamp="ts",
                         rename_fields={"levelname": "level", "name": "logger",
                                        "exc_info": "exception"})

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        fields = log_data.pop("fields", None) or {}
        event = log_data.pop("event", None)
        if event:
            log_data["message"] = event
        log_data.update(fields)


class StderrHandler(logging.StreamHandler):
    """A StreamHandler whose stream is whatever sys.stderr is when a record is written."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.setStream; stderr is not ours to pin
        pass


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr at `level` in `fmt` ("text" or "json"); calling again replaces the
    previous configuration."""
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, StderrHandler)]
    root.addHandler(handler)
    root.setLevel(level)
