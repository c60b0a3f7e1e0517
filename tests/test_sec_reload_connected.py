"""A SIGHUP that changes who may log in, or which ACL file applies, reaches the clients
connected before it (``mqttring.broker.security_reload``), as mosquitto 2 applies a reload.

Found by a black-box security probe (2026-11-29), each against a real node: an ``acl_file``
added (or another one named) left the clients connected before on no ACL (or the old
file's rules); a ``password_file`` added left connected the clients whose usernames no
file had ever checked, with the rights of the users they claimed to be; turning
``allow_anonymous`` off left the anonymous clients connected; a client closed because its
login was revoked still had its will published.  Real node processes, real SIGHUPs.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from mqtt_client import PUBACK, PUBLISH, SUBACK, RawClient, connect, publish, subscribe
from mqttring.security.passwords import format_entries, hash_password
from test_node_lifecycle import HOST, Node

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.kill()


def _start(tmp_path: Path, nodes: list[Node], config_text: str) -> tuple[Node, Path, int]:
    config = tmp_path / "node.toml"
    config.write_text(config_text)
    node = Node(tmp_path, "--mqtt", f"{HOST}:0", "--config", str(config))
    nodes.append(node)
    return node, config, int(node.wait_ready()["mqtt"])


def _reload(node: Node, config: Path, text: str, line: str) -> None:
    config.write_text(text)
    node.proc.send_signal(signal.SIGHUP)
    node.wait_line(line)


def _client(port: int, client_id: str, username: str | None = None,
            password: bytes | None = None, filters: tuple[str, ...] = ()) -> RawClient:
    c = RawClient(HOST, port, timeout=10)
    assert c.connect(client_id, username=username, password=password).return_code == 0
    if filters:
        c.send(subscribe(1, [(f, 1) for f in filters]))
        c.expect(SUBACK)
    return c


def _sees(c: RawClient, topic: str, marker: str, *, publish_topic: bool = True) -> bool:
    """Publish ``topic`` (unless another client does: ``publish_topic=False``) then
    ``marker`` as ``c``; whether ``topic`` came back before the marker (which ``c`` reads
    and writes): what did not arrive is proven without a clock."""
    sent = ((11, topic), (12, marker)) if publish_topic else ((12, marker),)
    for pid, t in sent:
        c.send(publish(t, b"x", qos=1, packet_id=pid))
    got: list[str] = []
    for _ in range(20):
        p = c.recv_packet(10)
        if p.type == PUBLISH:
            got.append(p.topic)
            if p.topic == marker:
                return topic in got
        else:
            assert p.type == PUBACK, p
    raise AssertionError(f"no marker: {got}")


ACL_PUBLIC = "topic readwrite public/#\n"
ACL_SECRET = "topic readwrite public/#\ntopic readwrite secret/#\n"


@pytest.mark.parametrize("before", [None, ACL_SECRET], ids=["acl-added", "acl-replaced"])
def test_an_acl_file_named_by_a_reload_applies_to_connected_clients(tmp_path, nodes, before):
    first = ""
    if before is not None:
        (tmp_path / "acl-old").write_text(before)
        first = f'acl_file = "{tmp_path / "acl-old"}"\n'
    node, config, port = _start(tmp_path, nodes, first)
    c = _client(port, "c1", filters=("secret/#", "public/#"))
    try:
        assert _sees(c, "secret/x", "public/m")  # allowed so far
        (tmp_path / "acl-new").write_text(ACL_PUBLIC)
        _reload(node, config, f'acl_file = "{tmp_path / "acl-new"}"\n', "reloaded: acl_file")
        assert not _sees(c, "secret/y", "public/m2"), (
            "the client connected before the reload still writes and reads secret/")
        assert _sees(c, "public/z", "public/m3")
    finally:
        c.close()


def test_a_password_file_added_by_a_reload_closes_unchecked_logins_without_their_wills(
        tmp_path, nodes):
    node, config, port = _start(tmp_path, nodes, "allow_anonymous = true\n")
    watcher = _client(port, "watcher", filters=("status/#", "mark/#"))
    impostor = RawClient(HOST, port, timeout=10)
    try:
        impostor.send(connect("bob-device", username="bob", password=b"anything",
                              will=("status/bob", b"gone", 1, False)))
        assert impostor.expect(2).return_code == 0  # no file: a username proves nothing
        pw = tmp_path / "passwords"
        pw.write_text(format_entries([("bob", hash_password(b"b-pw"))]))
        _reload(node, config, f'allow_anonymous = true\npassword_file = "{pw}"\n',
                "reloaded: password_file")
        assert impostor.wait_closed(10), "bob's unchecked login survived the password file"
        # The will's turn comes when the node sees the close; the marker goes after the log
        # says so, and must be the next thing the watcher (anonymous: it stays) reads.
        node.wait_line("will of 'bob-device' not published: its login was revoked")
        assert not _sees(watcher, "status/bob", "mark/end", publish_topic=False), (
            "the will of a login the reload revoked was published")
        again = RawClient(HOST, port, timeout=10)
        assert again.connect("bob-device", username="bob",
                             password=b"b-pw").return_code == 0
        again.close()
    finally:
        impostor.close()
        watcher.close()


def test_allow_anonymous_turned_off_by_a_reload_closes_anonymous_clients(tmp_path, nodes):
    pw = tmp_path / "passwords"
    pw.write_text(format_entries([("alice", hash_password(b"a-pw"))]))
    base = f'password_file = "{pw}"\n'
    node, config, port = _start(tmp_path, nodes, base + "allow_anonymous = true\n")
    anonymous = _client(port, "anon")
    alice = _client(port, "alice-1", "alice", b"a-pw", filters=("mark/#",))
    try:
        _reload(node, config, base + "allow_anonymous = false\n",
                "reloaded: allow_anonymous True -> False")
        assert anonymous.wait_closed(10), "an anonymous client stayed after the reload"
        assert _sees(alice, "mark/a", "mark/b")  # a checked login stays
    finally:
        anonymous.close()
        alice.close()


def test_an_empty_config_file_on_sighup_changes_nothing(tmp_path, nodes):
    """Caught while being rewritten (or truncated), an empty file reads as the defaults,
    which let anonymous clients in with no password file and no ACL: a reload refuses it."""
    pw = tmp_path / "passwords"
    pw.write_text(format_entries([("alice", hash_password(b"a-pw"))]))
    locked = f'allow_anonymous = false\npassword_file = "{pw}"\n'
    node, config, port = _start(tmp_path, nodes, locked)
    _reload(node, config, "", "config not reloaded")
    c = RawClient(HOST, port, timeout=10)
    try:
        assert c.connect("anonymous").return_code == 5  # still locked
    finally:
        c.close()
    _reload(node, config, locked + "auth_failures_allowed = 5\n",
            "reloaded: auth_failures_allowed 10 -> 5")  # a whole file is read again
