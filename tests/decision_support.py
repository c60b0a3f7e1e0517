"""What the decision tests share: a recording stand-in for the links and a real metadata
state machine driven by hand (no Raft, no processes), so each test builds exact views."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from mqttring.cluster.messages import Ack, Delivered, LinkMessage, ShareTrack
from mqttring.raft import state as sm
from mqttring.raft.view import ClusterView

NUM_SHARDS = 16


class Frames(NamedTuple):
    """What ``RecordingLinks.send_frames`` records: one run of a packed QoS 0 batch."""

    section: int
    topic: str
    frames: bytes
    count: int


class RecordingLinks:
    """The part of ``Links`` the router's anti-entropy uses, recording what it sends."""

    max_frame = 16 * 1024 * 1024

    def __init__(self) -> None:
        self.sent: list[tuple[str, LinkMessage]] = []
        #: node -> answers to its next requests (an exception is raised, a callable or an
        #: async function called first, so it can change the world meanwhile, the way the
        #: peer's answer or its delay would).
        self.answers: dict[str, list[Any]] = {}
        #: The same for the ``ShareTrack`` requests a node gets as a witness (apart, so that
        #: a test scripting deliveries need not count the records sent beside them).
        self.witness_answers: dict[str, list[Any]] = {}

    def send(self, node: str, message: LinkMessage) -> bool:
        self.sent.append((node, message))
        return True

    def send_frames(self, node: str, section: int, topic: str, frames: Any,
                    count: int = 1) -> None:
        """A run appended to the node's packed QoS 0 batch, recorded as a ``Frames``."""
        self.sent.append((node, Frames(section, topic, bytes(frames), count)))

    def send_control(self, node: str, message: LinkMessage) -> bool:
        self.sent.append((node, message))
        return True

    def reply(self, node: str, req: int, ok: bool, body: Any = None) -> None:
        self.sent.append((node, Ack(req, ok, body)))

    async def request(self, node: str, message: Any, timeout: float = 10.0,
                      *, expect: type | None = None) -> Any:
        """As scripted in ``answers``, else as if ``node`` accepted all at once (the
        decisions under test are the sender's)."""
        self.sent.append((node, message))
        return await self._answer(node, message, expect)

    def request_now(self, node: str, message: Any, timeout: float = 10.0) -> Any:
        """``request``, recorded as sent now; the answer is awaited through what it returns."""
        self.sent.append((node, message))
        return self._answer(node, message, None)

    async def _answer(self, node: str, message: Any, expect: type | None) -> Any:
        scripted = (self.witness_answers if type(message) is ShareTrack
                    else self.answers).get(node)
        if scripted:
            answer = scripted.pop(0)
            if inspect.iscoroutinefunction(answer):
                answer = await answer()
            elif callable(answer):
                answer = answer()
            if isinstance(answer, Exception):
                raise answer
            return answer
        return Delivered([]) if expect is Delivered else None

    def take(self, kind: type) -> list[tuple[str, Any]]:
        found = [(n, m) for n, m in self.sent if type(m) is kind]
        self.sent = [(n, m) for n, m in self.sent if type(m) is not kind]
        return found


class Metadata:
    """A real metadata state machine, driven by hand instead of through Raft."""

    def __init__(self, *nodes: str) -> None:
        self.state = sm.MetadataState()
        first, *rest = nodes
        self.state.apply(sm.cmd_bootstrap(NUM_SHARDS, 2, self.info(first)))
        for node in rest:
            self.join(node)

    @staticmethod
    def info(node: str) -> dict[str, Any]:
        return sm.member_info(node, f"{node}:1", f"{node}:2")

    def join(self, node: str) -> None:
        assert self.state.apply(sm.cmd_joining(self.info(node)))["ok"]
        assert self.state.apply(sm.cmd_up(node))["ok"]
        member = self.state.members[node]
        pending = list(self.state.view().catching_up_for(node))
        if pending:
            self.state.apply(sm.cmd_caught_up(node, member.incarnation, pending))

    def down(self, node: str) -> None:
        member = self.state.members[node]
        assert self.state.apply(sm.cmd_down(node, member.incarnation))["ok"]

    def leaving(self, node: str) -> None:
        assert self.state.apply(sm.cmd_leaving(node))["ok"]

    def remove(self, node: str) -> None:
        assert self.state.apply(sm.cmd_remove(node))["ok"]

    def view(self) -> ClusterView:
        return self.state.view()
