"""The ACL decides the same on every node of a 3-node cluster (``docs/security.md``): the
publisher's edge checks its writes, the node holding the subscriber's session checks reads,
with the publisher, the subscriber, the topic's owner and a persistent session's home on
different nodes.  Real node processes, real paho clients, every node with the same files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster_support import Client, Clients, NodeCluster, unique
from mqttring.security.passwords import format_entries, hash_password

pytestmark = pytest.mark.timeout(120)

NODES = ("a", "b", "c")
QUIET = 0.5

ACL = """\
user alice
topic read shared/#
topic deny shared/secret
topic readwrite alice/#
user bob
topic write shared/#
pattern readwrite devices/%c/#
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NodeCluster]:
    pw, acl = tmp_path / "passwords", tmp_path / "acl"
    pw.write_text(format_entries([("alice", hash_password(b"a-pw")),
                                  ("bob", hash_password(b"b-pw"))]))
    acl.write_text(ACL)
    root = tmp_path / "cluster"
    root.mkdir()
    c = NodeCluster(root)
    c.extra_toml = f'password_file = "{pw}"\nacl_file = "{acl}"\n'
    try:
        c.form_sync(*NODES)
        c.settle(NODES)
        yield c
    finally:
        c.close()


def connect(clients: Clients, port: int, client_id: str, user: str,
            clean: bool = True) -> Client:
    c = clients.make(port, client_id, clean)
    c.paho.username_pw_set(user, {"alice": "a-pw", "bob": "b-pw"}[user])
    c.connect()
    return c


def test_the_acl_holds_whatever_nodes_publisher_and_subscriber_are_on(cluster, clients):
    view = cluster.settle(NODES)
    port = cluster.port
    # A persistent alice homed at c but connected to a: her session (and its ACL check)
    # lives at c, which learns her username from the edge.
    remote_id = view.client_homed_at("c", "alice-p")
    persistent = connect(clients, port("a"), remote_id, "alice", clean=False)
    local = connect(clients, port("b"), unique("alice-c"), "alice")
    for sub in (persistent, local):
        assert sub.subscribe([("shared/#", 1), ("bob/#", 1)]) == [1, 0x80]
    bob = connect(clients, port("c"), unique("bob"), "bob")
    owned_by_b = view.topic_owned_by("b", "shared/owned")
    bob.publish("shared/secret", b"deny", qos=1, retain=True)
    bob.publish("alice/x", b"not bob's to write", qos=1, retain=True)
    bob.publish(owned_by_b, b"ok-1", qos=1)
    bob.publish("shared/open", b"ok-2", qos=1, retain=True)
    for sub in (persistent, local):
        got = sub.until(lambda d: {x.payload for x in d} >= {b"ok-1", b"ok-2"}, quiet=QUIET)
        assert sorted(d.payload for d in got) == [b"ok-1", b"ok-2"], got
    # Retained: the denied one never reaches a wildcard reader, the forged one was not kept.
    late = connect(clients, port("a"), unique("alice-late"), "alice")
    assert late.subscribe([("shared/#", 1), ("alice/#", 1)]) == [1, 1]
    got = late.until(lambda d: any(x.payload == b"ok-2" for x in d), quiet=QUIET)
    assert [(d.topic, d.payload, d.retain) for d in got] == [("shared/open", b"ok-2", True)]
    # %c on every node: a device writes its own tree only.
    dev = connect(clients, port("b"), "dev-9", "bob")
    assert dev.subscribe([("devices/dev-9/#", 1), ("devices/dev-8/#", 1)]) == [1, 0x80]
    other = connect(clients, port("c"), "dev-8", "bob")
    assert other.subscribe([("devices/dev-8/#", 1)]) == [1]
    dev.publish("devices/dev-8/cmd", b"forged", qos=1)
    dev.publish("devices/dev-9/state", b"mine", qos=1)
    got = dev.until(lambda d: any(x.payload == b"mine" for x in d), quiet=QUIET)
    assert [d.payload for d in got] == [b"mine"]
    assert other.drain(QUIET) == []
