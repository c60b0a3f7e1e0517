"""The ACL decides the same on every node of a 3-node cluster (``docs/security.md``): the
publisher's edge checks its writes, the node holding the subscriber's session checks reads,
with the publisher, the subscriber, the topic's owner and a persistent session's home on
different nodes.  Retained messages under denied topics stay unread whichever node holds
them, and SIGHUP makes each node read its ACL file again, the new rules reaching connected
clients and queued messages.  Real node processes, real paho clients, every node with its
own copy of the same files."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cluster_support import HOST, Client, Clients, NodeCluster, unique
from mqtt_client import PUBLISH, RawClient
from mqttring.security.passwords import format_entries, hash_password

pytestmark = pytest.mark.timeout(120)

NODES = ("a", "b", "c")
QUIET = 0.5

ACL = """\
user alice
topic read shared/#
topic deny shared/secret/#
topic readwrite alice/#
topic read feed/#
topic deny feed/closed/#
user bob
topic write shared/#
topic write feed/#
pattern readwrite devices/%c/#
pattern readwrite users/%u/#
"""

#: What the SIGHUP test swaps in: alice's read of ``feed`` turns around (``open`` denied,
#: ``closed`` readable) and bob may write ``feed/closed`` only.
ACL_AFTER = """\
user alice
topic read shared/#
topic deny shared/secret/#
topic readwrite alice/#
topic read feed/#
topic deny feed/open/#
user bob
topic write shared/#
topic write feed/closed/#
pattern readwrite devices/%c/#
pattern readwrite users/%u/#
"""


@pytest.fixture
def acl_files(tmp_path: Path) -> dict[str, Path]:
    """Each node's own ACL file (the same rules in each, as an operator copies them)."""
    files = {node: tmp_path / f"acl-{node}" for node in NODES}
    for path in files.values():
        path.write_text(ACL)
    return files


@pytest.fixture
def cluster(tmp_path: Path, acl_files: dict[str, Path]) -> Iterator[NodeCluster]:
    pw = tmp_path / "passwords"
    pw.write_text(format_entries([("alice", hash_password(b"a-pw")),
                                  ("bob", hash_password(b"b-pw"))]))
    root = tmp_path / "cluster"
    root.mkdir()
    c = NodeCluster(root)
    c.extra_toml = f'password_file = "{pw}"\n'
    c.node_toml = {node: f'acl_file = "{path}"\n' for node, path in acl_files.items()}
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


def test_patterns_and_denied_retained_messages_on_every_owner(cluster, clients):
    """``%u`` patterns decided at the session's home, and retained messages under denied
    topics held by each of the three nodes: a wildcard subscriber on any node, whose
    filters match those topics, gets only what it may read, on subscribe and live."""
    view = cluster.settle(NODES)
    port = cluster.port
    bob = connect(clients, port("c"), unique("bob"), "bob")
    alice = connect(clients, port("a"), unique("alice"), "alice")
    allowed, denied, alices = {}, {}, {}
    for owner in NODES:
        allowed[owner] = view.topic_owned_by(owner, "shared/pub")
        denied[owner] = view.topic_owned_by(owner, "shared/secret")
        alices[owner] = view.topic_owned_by(owner, "users/alice")
        bob.publish(allowed[owner], f"ok@{owner}".encode(), qos=1, retain=True)
        bob.publish(denied[owner], f"secret@{owner}".encode(), qos=1, retain=True)
        alice.publish(alices[owner], f"alice@{owner}".encode(), qos=1, retain=True)
    # Retained, on subscribe, from a subscriber on each node: "+/secret/#" overlaps her
    # grant on shared/# (granted), and brings nothing, being all inside the deny.
    expected = sorted((allowed[o], f"ok@{o}".encode()) for o in NODES)
    for node in NODES:
        sub = connect(clients, port(node), unique(f"alice-{node}"), "alice")
        assert sub.subscribe([("shared/#", 1), ("+/secret/#", 1)]) == [1, 1]
        got = sub.until(lambda d: len(d) >= len(NODES), quiet=QUIET)
        assert sorted((d.topic, d.payload) for d in got) == expected, (node, got)
        assert all(d.retain for d in got), got
        # Live: a new secret is not delivered either, a new open one is.
        bob.publish(denied[node], b"secret-live", qos=1)
        bob.publish(allowed[node], b"ok-live", qos=1)
        got = sub.until(lambda d: any(x.payload == b"ok-live" for x in d), quiet=QUIET)
        assert [(d.topic, d.payload) for d in got] == [(allowed[node], b"ok-live")], got
    # %u: bob's persistent session is homed at b and reached through c; its reads are
    # decided at b by the pattern with bob's name.  users/# is granted (it overlaps
    # users/bob/#) and brings none of alice's tree, retained or live.
    bob_id = view.client_homed_at("b", "bob-p")
    reader = connect(clients, port("c"), bob_id, "bob", clean=False)
    assert reader.subscribe([("users/#", 1), ("users/alice/#", 1)]) == [1, 0x80]
    mine = view.topic_owned_by("a", "users/bob")
    alice.publish(alices["a"], b"alice-live", qos=1)
    bob.publish(alices["b"], b"forged-by-bob", qos=1)  # not bob's to write: dropped
    bob.publish(mine, b"bob-own", qos=1)
    got = reader.until(lambda d: any(x.payload == b"bob-own" for x in d), quiet=QUIET)
    assert [(d.topic, d.payload) for d in got] == [(mine, b"bob-own")], got
    # alice sees her own tree, retained from every owner, and not what bob forged.
    own = connect(clients, port("b"), unique("alice-own"), "alice")
    assert own.subscribe([("users/#", 1)]) == [1]
    got = own.until(lambda d: len(d) >= len(NODES), quiet=QUIET)
    assert sorted(d.payload for d in got) == sorted(f"alice@{o}".encode() for o in NODES), got


RELOADED = ("SIGHUP: config reloaded, no setting changed; "
            "the password, ACL and certificate files re-read")


def reload_acl(cluster: NodeCluster, acl_files: dict[str, Path], text: str,
               timeout: float = 20.0) -> None:
    """Rewrite every node's ACL file, SIGHUP every node, wait for each to log the reload
    (after its files were read again) and check that the ACL file was among them."""
    before = {n: len(cluster.grep(n, RELOADED, limit=1000)) for n in NODES}
    for path in acl_files.values():
        path.write_text(text)
    for node in NODES:
        popen = cluster.procs[node].popen
        assert popen is not None and popen.poll() is None, f"{node} is not running"
        popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    for node in NODES:
        while len(cluster.grep(node, RELOADED, limit=1000)) <= before[node]:
            assert time.monotonic() < deadline, (
                f"{node} logged no reload in {timeout}s:\n{cluster.tail(node)}")
            time.sleep(0.05)
        assert cluster.grep(node, f"ACL file {acl_files[node]} loaded"), cluster.tail(node)
        assert not cluster.grep(node, "not reloaded"), cluster.tail(node)


def held(cluster: NodeCluster, home: str, client_id: str) -> int:
    """Messages the session's home holds for it, queued or sent and not acknowledged."""
    counts = trio.run(lambda: cluster.call(home, "session_counts", {"clients": [client_id]}))
    session = counts["sessions"].get(client_id, {})
    return int(session.get("queued", 0)) + int(session.get("inflight", 0))


def test_sighup_reloads_the_acl_on_every_node(cluster, clients, acl_files):
    """A new ACL file and SIGHUP to each node: the new rules apply to a connected
    subscriber (reads, decided where its session lives), to a publisher on another node
    (writes, decided at its edge), to new subscriptions, to retained messages held by
    each node, and to messages queued for an offline session before the change.  Each
    check is made before the reload too, where it comes out the other way."""
    view = cluster.settle(NODES)
    port = cluster.port
    topics = {kind: view.topic_owned_by("b", f"feed/{kind}") for kind in ("open", "closed",
                                                                          "other")}
    retained = {(kind, owner): view.topic_owned_by(owner, f"feed/{kind}/r")
                for kind in ("open", "closed") for owner in NODES}
    bob = connect(clients, port("c"), unique("bob"), "bob")
    for (kind, owner), topic in retained.items():
        bob.publish(topic, f"{kind}@{owner}".encode(), qos=1, retain=True)
    opens = {f"open@{o}".encode() for o in NODES}
    live = connect(clients, port("a"), unique("alice-live"), "alice")
    assert live.subscribe([("feed/#", 1)]) == [1]
    assert {d.payload for d in live.until(lambda d: len(d) >= len(NODES))} == opens
    # A persistent session homed at b, reached through c, that goes away holding one
    # message sent and never acknowledged (a raw client that does not PUBACK); the round
    # below queues two more.  (feed/+/+ leaves out the retained feed/*/r/* topics.)
    away_id = view.client_homed_at("b", "alice-away")
    away = RawClient(HOST, port("c"))
    try:
        assert away.connect(away_id, clean_session=False, username="alice",
                            password=b"a-pw").return_code == 0
        assert away.subscribe([("feed/+/+", 1)]) == [1]
        bob.publish(topics["open"], b"open-unacked", qos=1)
        unacked = away.expect(PUBLISH)
        assert (unacked.payload, unacked.qos) == (b"open-unacked", 1)
    finally:
        away.close()
    assert [d.payload for d in live.collect(1)] == [b"open-unacked"]

    def publish_round(tag: str) -> None:
        for kind, topic in topics.items():
            bob.publish(topic, f"{kind}-{tag}".encode(), qos=1)

    def live_round(tag: str, expect: set[str]) -> None:
        publish_round(tag)
        want = {f"{kind}-{tag}".encode() for kind in expect}
        got = live.until(lambda d: {x.payload for x in d if not x.retain} >= want,
                         quiet=QUIET)
        assert sorted(d.payload for d in got) == sorted(want), (tag, got)

    def fresh_subscriber(node: str) -> tuple[list[int], set[bytes]]:
        sub = connect(clients, port(node), unique(f"alice-{node}"), "alice")
        codes = sub.subscribe([("feed/#", 1), ("feed/closed/#", 1)])
        got = sub.until(lambda d: len(d) >= len(NODES), quiet=QUIET)
        sub.disconnect()
        return codes, {d.payload for d in got}

    # Before: open and other reach alice; closed is denied to her.
    live_round("before", {"open", "other"})
    deadline = time.monotonic() + 10
    while held(cluster, "b", away_id) < 3:  # open-unacked, open-before and other-before
        assert time.monotonic() < deadline, f"b holds {held(cluster, 'b', away_id)}"
        time.sleep(0.05)
    for node in NODES:
        codes, got = fresh_subscriber(node)
        assert codes == [1, 0x80]
        assert got == opens, (node, got)

    reload_acl(cluster, acl_files, ACL_AFTER)

    # After: the live subscriber now gets closed only (open: she may not read it; other:
    # bob may no longer write it, refused at his edge c).
    live_round("after", {"closed"})
    for node in NODES:
        codes, got = fresh_subscriber(node)
        assert codes == [1, 1]
        assert got == {f"closed@{o}".encode() for o in NODES}, (node, got)
    # Held before the change: open-unacked and open-before are dropped when her session
    # resumes (not sent again), other is still hers to read, and closed-after (published
    # while she was away) was queued.
    again = connect(clients, port("a"), away_id, "alice", clean=False)
    got = again.until(lambda d: len(d) >= 2, quiet=QUIET)
    assert sorted(d.payload for d in got) == [b"closed-after", b"other-before"], got


def test_a_will_whose_topic_the_reload_revoked_is_not_published(cluster, clients, acl_files):
    """A will goes out only if its client may still write its topic (as mosquitto decides
    when it publishes one): CONNECT checked it against the old rules, a reload took the
    right away, and the will's keeper, wherever the view puts it, asks the ACL as it is
    now.  Each will is homed on another node than its client's edge; the control before
    the reload is published."""
    view = cluster.settle(NODES)
    port = cluster.port
    alice = connect(clients, port("b"), unique("alice"), "alice")
    assert alice.subscribe([("feed/#", 1)]) == [1]

    def bob_with_will(edge: str, home: str, tag: str) -> Client:
        c = clients.make(port(edge), view.client_homed_at(home, f"bob-{tag}"), True)
        c.paho.username_pw_set("bob", "b-pw")
        c.connect(will=(f"feed/other/{tag}", f"will-{tag}".encode(), 1, False))
        return c

    control = bob_with_will("a", "c", "control")
    control.close()
    got = alice.until(lambda d: any(x.payload == b"will-control" for x in d), quiet=QUIET)
    assert [d.payload for d in got] == [b"will-control"]

    revoked = [bob_with_will("a", "c", "remote-home"), bob_with_will("c", "c", "local-home")]
    reload_acl(cluster, acl_files, ACL_AFTER)  # bob may write feed/closed/# only now
    for c in revoked:
        c.close()
    deadline = time.monotonic() + 20
    for tag in ("remote-home", "local-home"):
        needle = f"on 'feed/other/{tag}' not published: the ACL no longer lets it write"
        while not cluster.grep("c", needle):
            assert time.monotonic() < deadline, (tag, cluster.tail("c"))
            time.sleep(0.05)
    assert alice.drain(QUIET) == []
