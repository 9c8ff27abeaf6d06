"""Log output of prefixgate processes: text for people, JSON lines for log pipelines.

`configure(level, fmt)` sets the root logger's one prefixgate handler (idempotent: a second
call replaces it; handlers others installed, such as pytest's, stay). The handler looks
sys.stderr up at each record, never binding the stream of the moment: a command run
in-process (tests call `prefixgate.cli.main`) must not leave a handler writing to a
stream its caller has since closed. Structured records carry
their fields in `extra={"fields": {...}, "event": "..."}` (e.g. the gateway's one line per
turn, gateway/metrics.py) and say them as key=value in their text; the JSON format
(`--log-format json`) writes one object per line with ts, level, logger, message (the
event) and the fields as top-level keys.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name,
               "message": getattr(record, "event", None) or record.getMessage()}
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


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
