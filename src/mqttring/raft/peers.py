"""``<data_dir>/raft/peers.json``: the members a restarting node rejoins through.

A node that restarts has no ``--join`` of its own to rely on (the node it first joined
through may be gone); it asks the members it last knew.  The file is rewritten, atomically,
whenever the membership changes; an unreadable one is ignored with a warning (the node then
needs ``--join``), never fatal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mqttring.raft.view import ClusterView

#: The service's logger, not this module's: the lines keep the name they had before the split.
log = logging.getLogger("mqttring.raft.service")


class PeersFile:
    """One node's ``peers.json`` (none without a data directory: nothing is remembered)."""

    def __init__(self, data_dir: Path | None, node_id: str) -> None:
        self.path = None if data_dir is None else data_dir / "raft" / "peers.json"
        #: The members a node that left knew last (``remember_left``).
        self.left_path = None if data_dir is None else data_dir / "left.json"
        self.node_id = node_id
        self._saved: object = None

    def save(self, view: ClusterView) -> None:
        """Remember ``view``'s members, if this node is one and they changed."""
        path = self.path
        if path is None or self.node_id not in view.members or view.members == self._saved:
            return
        self._saved = view.members
        peers = {m.node_id: {"cluster": m.cluster, "raft": m.raft}
                 for m in view.members.values()}
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"epoch": view.epoch, "members": peers}))
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot save %s: %s", path, exc)

    def load(self) -> dict[str, dict[str, str]]:
        """node id -> {"cluster": address, "raft": address}; empty if none or unreadable."""
        path = self.path
        if path is None or not path.exists():
            return {}
        try:
            return dict(json.loads(path.read_text())["members"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return {}


    def remember_left(self, view: ClusterView) -> None:
        """This node left the cluster of ``view`` (its journal is gone): keep the others'
        cluster addresses, so that a start without ``--join`` rejoins through them rather
        than founding a second cluster on the same data (a split brain)."""
        if self.left_path is None:
            return
        others = sorted(m.cluster for m in view.members.values() if m.node_id != self.node_id)
        try:
            self.left_path.write_text(json.dumps({"members": others}))
        except OSError as exc:
            log.warning("cannot save %s: %s", self.left_path, exc)

    def load_left(self) -> list[str]:
        """The cluster addresses ``remember_left`` kept; empty if none or unreadable."""
        path = self.left_path
        if path is None or not path.exists():
            return []
        try:
            return [str(a) for a in json.loads(path.read_text())["members"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return []

    def forget_left(self) -> None:
        """A member again: its journal and ``peers.json`` say whom it knows."""
        if self.left_path is not None:
            self.left_path.unlink(missing_ok=True)


__all__ = ["PeersFile"]
