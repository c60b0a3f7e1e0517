"""One process per store directory: an advisory lock held for the store's whole life.

LMDB lets several processes open one environment, so two nodes started on the same data
directory (a second ``mqttring.node`` by mistake, a supervisor restarting a node whose old
process still runs) would both serve it: two sets of sessions and retained messages
written into one store, each node unaware of the other's writes.  A probe started two
such nodes and both served.  ``flock`` on a file in the directory refuses the second at
once, names the holder, and is released by the kernel when the holder dies, however.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from mqttring.lsm.ops import StoreError

LOCK_NAME = "mqttring.lock"


class DirLock:
    """Held from ``acquire`` to ``release`` (or the process's end)."""

    __slots__ = ("_fd", "path")

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path) -> DirLock:
        """Lock ``directory`` for this store; ``StoreError`` naming the holder if another
        store (another process, or another store object in this one) holds it."""
        path = directory / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot open the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = b""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 32, 0).strip()
            os.close(fd)
            who = f"process {holder.decode(errors='replace')}" if holder else "another process"
            raise StoreError(f"the store at {directory} is in use by {who}: one node per "
                             "data directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # (the lock goes with the descriptor; the file stays, harmless)
