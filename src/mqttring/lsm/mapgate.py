"""The gate between LMDB read transactions and growing the map.

``mdb_env_set_mapsize`` remaps the file; LMDB requires that no transaction of this process is
open while it runs, and does not check (a reader left on the old mapping reads unmapped
memory).  Every read transaction the store opens is therefore bracketed by ``reading()``,
and the flusher grows the map only inside ``exclusive()``, which first stops new readers and
then waits for the current ones to finish.  Readers on the trio event loop use
``try_enter`` and fall back to a worker thread while a growth is pending, so the loop itself
never waits here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class MapGate:
    __slots__ = ("_cond", "_growing", "_readers")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._growing = False

    def try_enter(self) -> bool:
        """Register a reader without waiting; False while a growth is pending."""
        with self._cond:
            if self._growing:
                return False
            self._readers += 1
            return True

    def enter(self) -> None:
        with self._cond:
            while self._growing:
                self._cond.wait()
            self._readers += 1

    def leave(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def reading(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold off all readers (waiting for open ones) for the duration of the block."""
        with self._cond:
            self._growing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._growing = False
                self._cond.notify_all()
