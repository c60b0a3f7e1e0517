"""How a node process logs: level, destination (stderr or a file) and format (text or JSON).

Only the node process (``python -m mqttring.node``, the ``--workers`` supervisor) configures
logging; an embedding application keeps its own.  ``--log-file`` appends through
``WatchedFileHandler``, which reopens the file when logrotate (or anyone) moves it away, so
rotation needs no signal.  ``--log-format json`` writes one JSON object per line (``time``,
``level``, ``logger``, ``message``, plus ``exception`` and any ``extra=`` fields of the call),
for log shippers that would otherwise parse the text with a regex.

``set_level`` is what a SIGHUP reload calls (``mqttring.reload``).

``WaitLog`` keeps a wait that retries several times a second (a node joining its cluster)
to a few lines: one when it starts, one every ``WAIT_REPORT_EVERY`` seconds while it lasts,
one when it ends.  A line per try buried everything else in the log and said nothing new
after the first.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
#: Characters of a client-chosen string (a topic, a username) a log line shows at most.
SHOWN_CHARS = 200
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every ``LogRecord`` has; anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}

#: Seconds between two "still waiting" lines of one ``WaitLog``.
WAIT_REPORT_EVERY = 10.0


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


class WaitLog:
    """The log lines of one wait made of quick retries (see the module docstring).

    The caller reports each failed try (``failed``) and the end (``done``).  The first
    failure is logged at info with what the wait is for; later ones at debug, except one
    info line with the latest reason every ``every`` seconds; ``done`` logs once, and only
    if there was a wait (a first try that succeeds logs nothing).
    """

    def __init__(self, logger: logging.Logger, what: str, *,
                 every: float = WAIT_REPORT_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        #: What is awaited, for the lines (e.g. "an answer to join from h:p or h:q").
        self.what = what
        self.every = every
        self._clock = clock
        self._started: float | None = None
        self._reported = 0.0
        #: Failed tries so far.
        self.failures = 0

    def failed(self, reason: str) -> None:
        now = self._clock()
        self.failures += 1
        if self._started is None:
            self._started = self._reported = now
            self._log.info("%s; waiting for %s (retrying; a line every %.0f s until then)",
                           reason, self.what, self.every)
        elif now - self._reported >= self.every:
            self._reported = now
            self._log.info("still waiting for %s after %.0f s (%d tries failed); last: %s",
                           self.what, now - self._started, self.failures, reason)
        else:
            self._log.debug("%s", reason)

    def done(self, how: str) -> None:
        if self._started is not None:
            self._log.info("%s after waiting %.1f s (%d tries failed)", how,
                           self._clock() - self._started, self.failures)
            self._started = None


__all__ = ["FORMATS", "LEVELS", "WAIT_REPORT_EVERY", "JsonFormatter", "WaitLog", "set_level",
           "setup_logging"]


def clipped(text: str | None, limit: int = SHOWN_CHARS) -> str | None:
    """``text`` as a log line shows it: at most ``limit`` characters, then how long it was.
    Topics and usernames are the client's to choose, up to 64 KB each: logged whole, a
    client repeating a denied publish wrote its own bytes to the log one for one (240 MB
    in 2 s from one connection, a black-box probe)."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} characters)"
