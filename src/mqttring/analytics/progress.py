"""A dependency-free progress bar on stderr for long exports.

Why not tqdm: one more runtime dependency for twenty lines.  On a terminal the bar redraws
in place at most ten times a second; when stderr is a file or a pipe (CI logs, tests) it
prints a plain line at every tenth of the work instead, so logs stay short and readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Counts units of work (rows) against a known total and draws them on ``stream``."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.total = max(total, 0)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = enabled and self._stream.isatty()
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_tenth = -1

    def advance(self, n: int) -> None:
        self.done += n
        if not self._enabled:
            return
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1:
                self._last_draw = now
                self._draw("\r")
        else:
            tenth = 10 * self.done // self.total if self.total else 10
            if tenth > self._last_tenth and tenth < 10:
                self._last_tenth = tenth
                self._draw("")

    def finish(self) -> None:
        if self._enabled:
            self._draw("\r" if self._tty else "")

    def _draw(self, prefix: str) -> None:
        fraction = self.done / self.total if self.total else 1.0
        width = 30
        filled = int(width * min(fraction, 1.0))
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {fraction:6.1%} "
                f"{self.done:,}/{self.total:,} rows {self.done / elapsed:,.0f} rows/s")
        end = "\n" if not self._tty or self.done >= self.total else ""
        self._stream.write(prefix + line + end)
        self._stream.flush()
