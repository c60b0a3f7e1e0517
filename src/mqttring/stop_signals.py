"""SIGINT, SIGTERM and SIGHUP held from a node process's first line until it listens for them.

A node process spends its first second or so importing (trio, msgspec, lmdb, pysyncobj),
then reads its config and files, and only then starts trio, whose signal receiver
(``mqttring.lifecycle``) turns a stop signal into a clean stop.  Before that receiver
existed, Python's defaults applied: SIGTERM killed the process (status 143, no log line)
and SIGINT raised ``KeyboardInterrupt`` wherever the import happened to be (a traceback and
status 130).  A service manager stopping a node it has just started (a failed deploy, a
quick restart) must get the same clean stop as a running node's.

``hold()`` installs a handler that only records the signal (safe at any point: it does not
raise into whatever code the main thread is running), so it is installed before anything
heavy is imported: this module imports the standard library only.  ``NodeLifecycle`` takes
what was recorded once its own receiver is open and acts on it as if it had just come.
The handler stays installed for the rest of the process: trio puts it back when its
receiver closes (and re-delivers any signal still queued there, which must not kill a node
that is already stopping).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

#: The signals a node acts on (``mqttring.lifecycle``): stop, stop, reload.
HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class HeldSignals:
    """What ``hold()`` recorded, in order of arrival, until someone ``take``s it."""

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._previous: dict[int, _Handler] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self._pending.append(signum)

    def take(self) -> list[int]:
        """The signals recorded since the last ``take`` (each is handed out once)."""
        taken, self._pending = self._pending, []
        return taken

    def release(self) -> None:
        """Put the previous handlers back and deliver what came meanwhile to them.

        For a process that turned out not to run a node (``mqttring status`` held the
        signals while it imported its subcommands): its Ctrl-C behaves as it always did.
        """
        global _held
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        _held = None
        for signum in self.take():
            signal.raise_signal(signum)


_held: HeldSignals | None = None


def hold() -> HeldSignals:
    """Record SIGINT/SIGTERM/SIGHUP from now on instead of acting on them; idempotent (the
    second call in a process returns what the first installed).

    Off the main thread (an embedding program calling ``mqttring.cli.main`` from one)
    Python allows no handler: nothing is held there and the program's own handling stays.
    """
    global _held
    if threading.current_thread() is not threading.main_thread():
        return HeldSignals()
    if _held is None:
        held = HeldSignals()
        for signum in HELD:
            held._previous[signum] = signal.signal(signum, held._record)
        _held = held
    return _held


__all__ = ["HELD", "HeldSignals", "hold"]
