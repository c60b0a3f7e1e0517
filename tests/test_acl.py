"""ACL files (``mqttring.security.acl``): the parser, mosquitto's decisions, patterns, reload,
and the session's check on delivery and on leaving its queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from mqttring.config import ConfigError
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session
from mqttring.security.acl import (
    Access,
    AccessControl,
    AclFile,
    AclParseError,
    covers,
    matches,
    overlaps,
)

ACL = """\
# anonymous clients
topic read public/#

user alice
topic readwrite alice/#
topic read shared/+
topic deny shared/secret
topic write inbox

user bob smith
topic sensors/#

pattern read devices/%c/config
pattern write devices/%c/state
pattern readwrite users/%u/#
pattern deny users/%u/locked
"""


def access(tmp_path: Path, username: str | None, client_id: str = "c1", text: str = ACL):
    f = tmp_path / "acl"
    f.write_text(text)
    holder = AccessControl(f)
    return holder, holder.for_client(username, client_id)


def test_users_anonymous_and_default_deny(tmp_path):
    _, alice = access(tmp_path, "alice")
    assert alice.may_read("alice/x") and alice.may_write("alice/x/y")
    assert alice.may_read("shared/a") and not alice.may_write("shared/a")
    assert not alice.may_read("shared/secret"), "deny wins over the read grant"
    assert alice.may_write("inbox") and not alice.may_read("inbox")
    assert not alice.may_read("public/x"), "anonymous rules are not alice's"
    assert not alice.may_read("other"), "not granted means denied"
    _, anon = access(tmp_path, None)
    assert anon.may_read("public/a/b") and not anon.may_write("public/a")
    assert not anon.may_read("alice/x")
    _, bob = access(tmp_path, "bob smith")
    assert bob.may_read("sensors/1") and bob.may_write("sensors/1"), "no word: readwrite"
    _, stranger = access(tmp_path, "mallory")
    assert not stranger.may_read("public/a"), "a user without rules gets nothing but patterns"


def test_patterns_substitute_client_id_and_username(tmp_path):
    _, c = access(tmp_path, "mallory", "dev-7")
    assert c.may_read("devices/dev-7/config") and not c.may_write("devices/dev-7/config")
    assert c.may_write("devices/dev-7/state") and not c.may_read("devices/dev-8/config")
    assert c.may_read("users/mallory/a") and c.may_write("users/mallory/a/b")
    assert not c.may_read("users/mallory/locked"), "a pattern deny"
    assert not c.may_read("users/alice/a")
    _, anon = access(tmp_path, None, "dev-7")
    assert anon.may_read("devices/dev-7/config"), "patterns apply to anonymous clients"
    assert not anon.may_read("users/%u/a") and not anon.may_read("users/+/a")
    _, sneaky = access(tmp_path, "a/b", "+")
    assert not sneaky.may_read("devices/x/config"), "an id with + never widens a pattern"
    assert not sneaky.may_read("users/a/b/x")


def test_a_subscription_is_refused_only_when_it_can_bring_nothing_readable(tmp_path):
    _, alice = access(tmp_path, "alice")
    assert alice.may_subscribe("alice/#") and alice.may_subscribe("shared/+")
    assert alice.may_subscribe("shared/a") and alice.may_subscribe("shared/#")
    assert alice.may_subscribe("#") and alice.may_subscribe("+/x")
    assert not alice.may_subscribe("inbox"), "write-only"
    assert not alice.may_subscribe("shared/secret"), "wholly denied"
    assert not alice.may_subscribe("other/#") and not alice.may_subscribe("shared/a/b")
    # Granted wildcards still bring only readable topics: checked per message.
    assert alice.may_read("shared/a") and not alice.may_read("shared/secret")
    assert not alice.may_read("shared/a/b")


@pytest.mark.parametrize(("a", "b", "overlap", "a_covers_b"), [
    ("a/#", "a", True, True), ("a/+", "a/#", True, False), ("a/b", "a/+", True, False),
    ("a/+", "a/b", True, True), ("#", "$SYS/x", False, False), ("$SYS/#", "$SYS/+", True, True),
    ("a/b", "a/c", False, False), ("+/+", "a", False, False), ("a/+/c", "a/b/#", True, False),
])
def test_overlap_and_cover(a, b, overlap, a_covers_b):
    la, lb = tuple(a.split("/")), tuple(b.split("/"))
    assert overlaps(la, lb) is overlap and overlaps(lb, la) is overlap
    assert covers(la, lb) is a_covers_b


def test_sys_topics_need_a_dollar_rule(tmp_path):
    _, c = access(tmp_path, "u", text="user u\ntopic read #\ntopic read $SYS/broker/#\n")
    assert c.may_read("$SYS/broker/uptime") and not c.may_read("$SYS/other")
    assert c.may_subscribe("$SYS/broker/#") and c.may_subscribe("$SYS/#")
    assert not c.may_subscribe("$SYS/other/#")
    assert not matches(("+", "x"), "$SYS/x") and matches(("$SYS", "#"), "$SYS")


@pytest.mark.parametrize(("text", "where"), [
    ("topic read a/#/b\n", "acl:1: topic 'a/#/b': '#' must be a whole level"),
    ("\nuser\n", "acl:2: 'user' needs a username"),
    ("topic read\n", "the topic filter is missing"),
    ("# c\nfoo bar\n", "acl:2: unknown directive 'foo'"),
    ("pattern read a/x%c\n", "%c and %u must be a whole topic level"),
    ("topic read a+/b\n", "'+' must be a whole level"),
    # A misspelled access word was read as part of the filter: a grant, not a deny.
    ("user alice\ntopic Deny shared/secret\n", "acl:2: invalid access type 'Deny'"),
    ("pattern raed devices/%c\n", "acl:1: invalid access type 'raed'"),
])
def test_parse_errors_name_the_line(text, where):
    with pytest.raises(AclParseError) as err:
        AclFile.parse(text, "acl")
    assert where in str(err.value) and isinstance(err.value, ConfigError)


def test_tabs_separate_words_like_spaces():
    """"topic deny<TAB>shared/secret" was read as a grant of the filter
    "deny\tshared/secret" (words split at spaces only), so alice read the secret (a
    black-box probe).  A filter may still hold spaces after its access word."""
    acl = AclFile.parse("user\talice\ntopic\tread\tshared/#\ntopic deny\tshared/secret\n"
                        "topic\t read \t with space/x \n")
    rules = acl.users["alice"]
    assert [(r.access, r.filter) for r in rules] == [
        (Access.READ, "shared/#"), (Access.DENY, "shared/secret"),
        (Access.READ, "with space/x")]


def test_reload_swaps_rules_for_connected_clients_and_keeps_old_on_error(tmp_path):
    holder, alice = access(tmp_path, "alice")
    assert alice.may_read("alice/x")
    (tmp_path / "acl").write_text("user alice\ntopic read other\n")
    holder.reload()
    assert not alice.may_read("alice/x") and alice.may_read("other")
    (tmp_path / "acl").write_text("user alice\ntopic a/b\nbroken line\n")
    with pytest.raises(AclParseError, match=":3: unknown directive 'broken'"):
        holder.reload()
    assert alice.may_read("other"), "a bad file leaves the old rules in force"
    with pytest.raises(AclParseError, match="cannot read ACL file"):
        AclFile.load(tmp_path / "missing")


def test_session_filters_on_delivery_and_when_its_queue_drains(tmp_path):
    holder, alice = access(tmp_path, "alice")
    session = Session("c1", False)
    session.access = alice
    session.deliver(Message("shared/secret", b"no", 1), 1)
    session.deliver(Message("alice/a", b"yes", 1), 1)
    session.deliver(Message("shared/x", b"later denied", 1), 1)
    assert [e.message.payload for e in session.queue] == [b"yes", b"later denied"]
    (tmp_path / "acl").write_text("user alice\ntopic read alice/#\n")
    holder.reload()
    out = bytearray()
    session.attach(out)
    assert b"yes" in out and b"later denied" not in out
    assert not session.queue and len(session.inflight) == 1


def test_the_documented_acl_sample_parses():
    """The ACL sample in docs/security.md (the block after "ACL file") is a valid file."""
    doc = (Path(__file__).parents[1] / "docs" / "security.md").read_text()
    sample = doc.split("## ACL file", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    acl = AclFile.parse(sample, "docs/security.md")
    assert set(acl.users) == {"alice", "bob"} and len(acl.patterns) == 2
