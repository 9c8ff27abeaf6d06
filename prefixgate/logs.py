"""Log output of prefixgate processes: text for people, JSON lines for log pipelines.

`configure(level, fmt)` sets the root logger once per process. Structured records carry
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


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr at `level` in `fmt` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
