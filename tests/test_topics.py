"""Topic validation, the reference matcher, and the two trees checked against it.

The reference ``topic_matches`` is itself checked against an independent regex translation
of section 4.7, and the trees against the reference under hypothesis-generated operation
sequences (rule-based state machines with a dict as the model).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mqttring.protocol.errors import InvalidTopic, MalformedPacket
from mqttring.protocol.topics import (
    TopicIndex,
    TopicTrie,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)

# ------------------------------------------------------------------------------ strategies

# A deliberately small alphabet so that filters and topics collide often, including '$'
# levels (first and later), empty levels and non-ASCII.
TOPIC_LEVELS = st.sampled_from(["a", "b", "", "$s", "$SYS", "ü"])
FILTER_LEVELS = st.sampled_from(["a", "b", "", "$s", "+", "+", "ü"])


def _nonempty(levels: list[str]) -> bool:
    return levels != [""]


topics = st.lists(TOPIC_LEVELS, min_size=1, max_size=4).filter(_nonempty).map("/".join)


@st.composite
def topic_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(FILTER_LEVELS, min_size=0, max_size=4))
    if not levels or draw(st.booleans()):
        levels.append("#")
    if levels == [""]:
        levels = ["+"]
    return "/".join(levels)


KEYS = st.sampled_from(["c1", "c2", "c3"])

# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "name", ["a", "a/b", "/", "//", "a//b", "$SYS/broker", "ü/€/😀", " ", "a/b/", "/a"]
)
def test_valid_topic_names(name: str) -> None:
    validate_topic_name(name)


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "MQTT-4.7.3-1"),
        ("a/+", "MQTT-3.3.2-2"),
        ("+", "MQTT-3.3.2-2"),
        ("#", "MQTT-3.3.2-2"),
        ("a/#", "MQTT-3.3.2-2"),
        ("a+b", "MQTT-3.3.2-2"),
        ("a\x00b", "MQTT-4.7.3-2"),
        ("a" * 65536, "MQTT-4.7.3-3"),
        ("€" * 21846, "MQTT-4.7.3-3"),  # 65538 UTF-8 bytes but only 21846 characters
        ("a\ud800", "MQTT-1.5.3-1"),
    ],
)
def test_invalid_topic_names(name: str, rule: str) -> None:
    with pytest.raises(InvalidTopic) as info:
        validate_topic_name(name)
    assert info.value.rule == rule
    assert isinstance(info.value, MalformedPacket)
    assert str(info.value).startswith(f"[{rule}]")


def test_topic_length_limit_is_in_bytes() -> None:
    validate_topic_name("a" * 65535)
    validate_topic_name("€" * 21845)  # exactly 65535 bytes
    validate_topic_filter("€" * 21845)


@pytest.mark.parametrize(
    "topic_filter",
    ["#", "+", "a/#", "a/+", "+/+", "+/#", "/+", "a//+", "$SYS/#", "a/+/b/#", "//#", "a", "/"],
)
def test_valid_topic_filters(topic_filter: str) -> None:
    validate_topic_filter(topic_filter)


@pytest.mark.parametrize(
    ("topic_filter", "rule"),
    [
        ("", "MQTT-4.7.3-1"),
        ("a/#/b", "MQTT-4.7.1-2"),
        ("#/a", "MQTT-4.7.1-2"),
        ("#a", "MQTT-4.7.1-2"),
        ("a#", "MQTT-4.7.1-2"),
        ("a/b#", "MQTT-4.7.1-2"),
        ("##", "MQTT-4.7.1-2"),
        ("a+", "MQTT-4.7.1-3"),
        ("+a", "MQTT-4.7.1-3"),
        ("a/+b/c", "MQTT-4.7.1-3"),
        ("++", "MQTT-4.7.1-3"),
        ("a/\x00", "MQTT-4.7.3-2"),
        ("a" * 65536, "MQTT-4.7.3-3"),
        ("\udfff", "MQTT-1.5.3-1"),
    ],
)
def test_invalid_topic_filters(topic_filter: str, rule: str) -> None:
    with pytest.raises(InvalidTopic) as info:
        validate_topic_filter(topic_filter)
    assert info.value.rule == rule


# ------------------------------------------------------------------------------ reference


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        # The examples of section 4.7.1.
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/#", "sport", True),
        ("#", "sport/tennis", True),
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("+/tennis/#", "sport/tennis/x", True),
        # Section 4.7.2: '$' topics and wildcards in the first level.
        ("#", "$SYS/monitor/Clients", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("$SYS/#", "$SYS/monitor/Clients", True),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
        ("$SYS/#", "$SYS", True),
        ("a/+", "a/$b", True),
        ("a/#", "a/$b", True),
        # Empty levels, exact matches, case sensitivity.
        ("a/+/b", "a//b", True),
        ("a//b", "a//b", True),
        ("a/b", "a/b", True),
        ("A/b", "a/b", False),
        ("a/b", "a/b/c", False),
        ("a/b/c", "a/b", False),
        ("#", "/", True),
        ("+/+", "/", True),
        ("+", "/", False),
    ],
)
def test_topic_matches_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


def _regex_matches(topic_filter: str, topic: str) -> bool:
    """An independent formulation of section 4.7 used to check the reference itself."""
    if topic.startswith("$") and topic_filter[0] in "+#":
        return False
    levels = topic_filter.split("/")
    pattern = ""
    for i, level in enumerate(levels):
        sep = "/" if i else ""
        if level == "#":
            # '#' matches the parent level too, so the separator before it is optional.
            pattern += "(/.*)?" if i else ".*"
        elif level == "+":
            pattern += sep + "[^/]*"
        else:
            pattern += sep + re.escape(level)
    return re.fullmatch(pattern, topic, flags=re.DOTALL) is not None


@given(topic_filters(), topics)
@settings(max_examples=1000)
def test_reference_agrees_with_regex_model(topic_filter: str, topic: str) -> None:
    validate_topic_filter(topic_filter)
    validate_topic_name(topic)
    assert topic_matches(topic_filter, topic) == _regex_matches(topic_filter, topic)


# ------------------------------------------------------------------------------ TopicTrie


def _trie_nodes(trie: TopicTrie[str, int]) -> int:
    count = 0
    stack = [trie._root]
    while stack:
        node = stack.pop()
        count += 1
        # The wildcard shortcuts must mirror the children dict (no stale, pruned nodes).
        assert node.plus is node.children.get("+")
        assert node.hash is node.children.get("#")
        stack.extend(node.children.values())
    return count - 1


def _prefix_count(filters: set[str]) -> int:
    prefixes = set()
    for topic_filter in filters:
        levels = topic_filter.split("/")
        prefixes.update(tuple(levels[: i + 1]) for i in range(len(levels)))
    return len(prefixes)


class TrieMachine(RuleBasedStateMachine):
    """TopicTrie against a dict {(filter, key): value} and ``topic_matches``."""

    def __init__(self) -> None:
        super().__init__()
        self.trie: TopicTrie[str, int] = TopicTrie()
        self.model: dict[tuple[str, str], int] = {}

    @rule(topic_filter=topic_filters(), key=KEYS, value=st.integers(0, 2))
    def add(self, topic_filter: str, key: str, value: int) -> None:
        is_new = (topic_filter, key) not in self.model
        assert self.trie.add(topic_filter, key, value) is is_new
        self.model[(topic_filter, key)] = value

    @rule(topic_filter=topic_filters(), key=KEYS)
    def remove(self, topic_filter: str, key: str) -> None:
        existed = self.model.pop((topic_filter, key), None) is not None
        assert self.trie.remove(topic_filter, key) is existed

    @rule(data=st.data())
    def remove_existing(self, data: st.DataObject) -> None:
        if not self.model:
            return
        topic_filter, key = data.draw(st.sampled_from(sorted(self.model)))
        del self.model[(topic_filter, key)]
        assert self.trie.remove(topic_filter, key)

    @rule(topic=topics)
    def match(self, topic: str) -> None:
        expected = Counter(
            (key, value)
            for (topic_filter, key), value in self.model.items()
            if topic_matches(topic_filter, topic)
        )
        assert Counter(self.trie.match(topic)) == expected
        assert self.trie.match_keys(topic) == {key for key, _ in expected}
        best: dict[str, int] = {}
        for key, value in expected.elements():
            best[key] = max(value, best.get(key, value))
        assert self.trie.match_max(topic) == best

    @rule(topic_filter=topic_filters())
    def get(self, topic_filter: str) -> None:
        expected = {k: v for (f, k), v in self.model.items() if f == topic_filter}
        assert self.trie.get(topic_filter) == expected

    @invariant()
    def sizes_filters_and_pruning(self) -> None:
        assert len(self.trie) == len(self.model)
        live = {topic_filter for topic_filter, _ in self.model}
        assert sorted(self.trie.filters()) == sorted(live)
        assert sorted(self.trie.items()) == sorted((f, k, v) for (f, k), v in self.model.items())
        # Pruning: exactly one node per distinct level-prefix of a live filter.
        assert _trie_nodes(self.trie) == _prefix_count(live)


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


@given(st.lists(st.tuples(topic_filters(), KEYS), max_size=30), topics)
@settings(max_examples=500)
def test_trie_match_equals_reference(entries: list[tuple[str, str]], topic: str) -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    for topic_filter, key in entries:
        trie.add(topic_filter, key, 1)
    expected = Counter(
        key for topic_filter, key in set(entries) if topic_matches(topic_filter, topic)
    )
    assert Counter(key for key, _ in trie.match(topic)) == expected


def test_trie_overlapping_filters_report_each_subscription() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    assert trie.add("a/+", "c1", 1)
    assert trie.add("a/#", "c1", 2)
    assert trie.add("#", "c2", 0)
    assert not trie.add("#", "c2", 1)  # re-subscribe replaces the QoS
    assert len(trie) == 3
    assert sorted(trie.match("a/b")) == [("c1", 1), ("c1", 2), ("c2", 1)]
    assert trie.match_max("a/b") == {"c1": 2, "c2": 1}
    assert sorted(trie.match("a")) == [("c1", 2), ("c2", 1)]  # 'a/#' matches the parent
    assert trie.match("$SYS/a") == []
    assert sorted(trie.match("a//")) == [("c1", 2), ("c2", 1)]


def test_trie_prunes_to_empty_and_rejects_invalid_filters() -> None:
    trie: TopicTrie[str, int] = TopicTrie()
    for topic_filter in ["a/b/c", "a/b", "a/+/#", "#", "+/x"]:
        trie.add(topic_filter, "k", 0)
    assert not trie.remove("a/b/c/d", "k")
    assert not trie.remove("a/b", "other")
    for topic_filter in ["a/b", "a/b/c", "#", "+/x", "a/+/#"]:
        assert trie.remove(topic_filter, "k")
    assert len(trie) == 0
    assert trie._root.children == {}
    assert list(trie.filters()) == []
    with pytest.raises(InvalidTopic) as info:
        trie.add("a/#/b", "k", 0)
    assert info.value.rule == "MQTT-4.7.1-2"
    assert len(trie) == 0


# ------------------------------------------------------------------------------ TopicIndex


class IndexMachine(RuleBasedStateMachine):
    """TopicIndex against a dict {topic: value} and ``topic_matches``."""

    def __init__(self) -> None:
        super().__init__()
        self.index: TopicIndex[int] = TopicIndex()
        self.model: dict[str, int] = {}

    @rule(topic=topics, value=st.integers())
    def set(self, topic: str, value: int) -> None:
        self.index.set(topic, value)
        self.model[topic] = value

    @rule(topic=topics)
    def discard(self, topic: str) -> None:
        existed = self.model.pop(topic, None) is not None
        assert self.index.discard(topic) is existed

    @rule(data=st.data())
    def discard_existing(self, data: st.DataObject) -> None:
        if not self.model:
            return
        topic = data.draw(st.sampled_from(sorted(self.model)))
        del self.model[topic]
        assert self.index.discard(topic)

    @rule(topic_filter=topic_filters())
    def match(self, topic_filter: str) -> None:
        got = list(self.index.match(topic_filter))
        assert len(got) == len(dict(got))  # each topic once
        expected = {t: v for t, v in self.model.items() if topic_matches(topic_filter, t)}
        assert dict(got) == expected

    @rule(topic=topics)
    def get(self, topic: str) -> None:
        assert self.index.get(topic) == self.model.get(topic)
        assert (topic in self.index) is (topic in self.model)

    @invariant()
    def size_and_pruning(self) -> None:
        assert len(self.index) == len(self.model)
        assert self.index.count_outside_dollar() == len(list(self.index.match("#")))
        assert dict(self.index.items()) == self.model
        nodes = 0
        stack = [self.index._root]
        while stack:
            node = stack.pop()
            nodes += 1
            stack.extend(node.children.values())
        assert nodes - 1 == _prefix_count(set(self.model))


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_index_match_snapshot_allows_mutation() -> None:
    index: TopicIndex[bytes] = TopicIndex()
    for topic in ["a", "a/b", "a/c", "$SYS/x", "b"]:
        index.set(topic, topic.encode())
    seen = []
    for topic, value in index.match("a/#"):
        index.discard(topic)  # a replay that clears retained messages as it goes
        seen.append((topic, value))
    assert sorted(seen) == [("a", b"a"), ("a/b", b"a/b"), ("a/c", b"a/c")]
    assert sorted(t for t, _ in index.match("#")) == ["b"]
    assert [t for t, _ in index.match("$SYS/+")] == ["$SYS/x"]
    assert index.get("missing", b"d") == b"d"
    with pytest.raises(InvalidTopic):
        index.set("a/+", b"")


def test_index_match_follows_filter_without_scanning() -> None:
    """A literal-prefixed filter must not visit unrelated subtrees."""
    index: TopicIndex[int] = TopicIndex()
    for i in range(200):
        index.set(f"big/{i}/x", i)
    index.set("small/x", -1)
    big = index._root.children["big"]
    visited: list[str] = []

    class Spy(dict):  # records any traversal of the 'big' subtree
        def items(self):  # type: ignore[override]
            visited.append("items")
            return super().items()

        def values(self):  # type: ignore[override]
            visited.append("values")
            return super().values()

    big.children = Spy(big.children)
    assert list(index.match("small/+")) == [("small/x", -1)]
    assert list(index.match("small/#")) == [("small/x", -1)]
    assert visited == []
    assert len(list(index.match("+/+/x"))) == 200
    assert visited  # while a leading wildcard does walk it
