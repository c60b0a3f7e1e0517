"""How a node process logs: level, destination (stderr or a file) and format (text or JSON).

Only the node process (``python -m mqttring.node``, the ``--workers`` supervisor) configures
logging; an embedding application keeps its own.  ``--log-file`` appends through
``WatchedFileHandler``, which reopens the file when logrotate (or anyone) moves it away, so
rotation needs no signal.  ``--log-format json`` writes one JSON object per line (``time``,
``level``, ``logger``, ``message``, plus ``exception`` and any ``extra=`` fields of the call),
for log shippers that would otherwise parse the text with a regex.

``set_level`` is what a SIGHUP reload calls (``mqttring.reload``).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every ``LogRecord`` has; anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages stay escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                entry[key] = value if isinstance(value, str | int | float | bool | None) \
                    else repr(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "info", file: Path | None = None, fmt: str = "text") -> None:
    """Replace the root logger's handlers with one for ``file`` (or stderr) in ``fmt``.

    Raises ``OSError`` when the file cannot be opened (the caller reports it in one line).
    """
    handler: logging.Handler
    if file is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.WatchedFileHandler(file, mode="a", encoding="utf-8")
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())


__all__ = ["FORMATS", "LEVELS", "JsonFormatter", "set_level", "setup_logging"]
