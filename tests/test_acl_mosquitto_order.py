"""The order in which ACL rules decide, against a real mosquitto with the same file.

mosquitto 2.x walks a client's own rules (its ``user`` section, or the anonymous ``topic``
lines) first, denials first, and only if none of them matches the topic does it walk the
``pattern`` lines (denials first again).  mqttring refused whenever any matching rule was a
deny: a user's ``topic readwrite alice/#`` with ``pattern deny alice/%c`` gave alice the
topic under mosquitto and not here (a black-box probe), so a file written for mosquitto
gave fewer rights.  Each case publishes at QoS 1 as the client and reports whether its own
subscription got it back (a readable marker proves what did not arrive, without a clock).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mosquitto_support import mosquitto
from mqtt_client import PUBACK, PUBLISH, SUBACK, RawClient, publish, subscribe

pytestmark = pytest.mark.timeout(120)

ACL = """\
topic readwrite anon/#
topic deny anon/secret
topic readwrite mark/#

user alice
topic readwrite alice/#
topic deny alice/locked
topic read shared/#
topic readwrite mark/#

pattern deny alice/%c
pattern readwrite alice/locked
pattern write shared/%c
pattern readwrite devices/%c/#
pattern deny devices/%c/off
pattern readwrite anon/secret
"""

#: (username, client id, topic): mosquitto's answer is what both must give.
CASES = [
    ("alice", "alice1", "alice/alice1"),   # own grant; a pattern denies: own wins
    ("alice", "alice1", "alice/locked"),   # own deny; a pattern grants: own wins
    ("alice", "alice1", "shared/alice1"),  # own read only, pattern write: patterns decide
    ("alice", "alice1", "devices/alice1/on"),   # patterns only: granted
    ("alice", "alice1", "devices/alice1/off"),  # patterns only: deny first
    (None, "anon1", "anon/secret"),        # the anonymous lines deny; a pattern grants
    (None, "anon1", "anon/x"),
    (None, "anon1", "devices/anon1/off"),
]


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:  # bounded: until the broker listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "broker did not start"
            time.sleep(0.05)


@contextlib.contextmanager
def _node(tmp_path: Path, acl: Path) -> Iterator[int]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mqttring.node", "--mqtt", "127.0.0.1:0", "--data-dir",
         str(tmp_path / "data"), "--sys-interval", "0", "--acl-file", str(acl),
         "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():  # bounded: until the node says where it listens
            assert proc.poll() is None and time.monotonic() < deadline, "node did not start"
            time.sleep(0.05)
        port = int(json.loads(ready.read_text())["mqtt"])
        _wait_listening(port, proc)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def _round_trip(port: int, username: str | None, client_id: str, topic: str) -> bool:
    """Whether ``topic``, published by the client, reaches its own subscription to it."""
    marker = f"mark/{client_id}"
    c = RawClient("127.0.0.1", port, timeout=10)
    try:
        assert c.connect(client_id, username=username, timeout=10).return_code == 0
        c.send(subscribe(1, [(topic, 1), (marker, 1)]))
        c.expect(SUBACK, 10)
        got: list[str] = []
        for pid, t in ((2, topic), (3, marker)):
            c.send(publish(t, b"x", qos=1, packet_id=pid))
        acks = 0
        for _ in range(20):
            p = c.recv_packet(10)
            if p.type == PUBACK:
                acks += 1
            elif p.type == PUBLISH:
                got.append(p.topic)
                if p.topic == marker:
                    break
        return topic in got
    finally:
        c.close()


def test_own_rules_decide_before_patterns_as_in_mosquitto(tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    settings = f"allow_anonymous true\nacl_file {acl}\n"
    with mosquitto(tmp_path, settings) as theirs, _node(tmp_path, acl) as ours:
        expected = {case: _round_trip(theirs, *case) for case in CASES}
        got = {case: _round_trip(ours, *case) for case in CASES}
    assert expected[("alice", "alice1", "alice/alice1")], "mosquitto's own-rules-first"
    assert got == expected, {c: (got[c], expected[c]) for c in CASES if got[c] != expected[c]}
