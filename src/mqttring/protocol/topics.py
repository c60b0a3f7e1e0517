"""Topic names, topic filters and the two trees that match one against the other.

Theory of operation
-------------------
MQTT matching runs in two directions and each gets its own tree:

* ``TopicTrie`` maps *filters* to subscribers.  A PUBLISH carries a concrete topic name and
  the router asks "who is subscribed?".  The walk splits the topic once and advances a small
  frontier of trie nodes level by level, following the literal child and the ``+`` child, and
  collecting ``#`` children on the way.  Its cost depends on the topic's depth and on how many
  wildcard branches are alive, never on the total number of filters.
* ``TopicIndex`` maps concrete *topic names* to a value (the retained message).  A SUBSCRIBE
  carries a filter and asks "which retained topics match?".  The walk follows the filter:
  literal levels are dict lookups, ``+`` fans out over one level, ``#`` takes a subtree, so a
  filter without a leading ``#`` never scans the whole index.

Both trees store one node per topic level in plain dicts and prune nodes that become empty on
removal, so memory follows the live subscriptions and retained messages, not their history.

``topic_matches`` is the slow, obviously-correct reference; the property tests check both
trees against it and the cluster uses it where a tree is not worth building.

The ``$`` rule [MQTT-4.7.2-1]: a filter whose *first* level is a wildcard never matches a topic
whose first level starts with ``$`` (``#`` does not see ``$SYS/...``; ``$SYS/#`` does).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from mqttring.protocol.errors import InvalidTopic

__all__ = [
    "TopicIndex",
    "TopicTrie",
    "topic_matches",
    "validate_topic_filter",
    "validate_topic_name",
]

K = TypeVar("K")
V = TypeVar("V")

_MAX_TOPIC_BYTES = 0xFFFF
# A code point takes at most 4 UTF-8 bytes, so shorter strings cannot exceed the limit and the
# common case skips encoding entirely.
_SAFE_TOPIC_CHARS = _MAX_TOPIC_BYTES // 4


def _check_common(topic: str, what: str) -> None:
    """Rules shared by names and filters: non-empty, no U+0000, encodable, <= 65535 bytes."""
    if not topic:
        raise InvalidTopic("MQTT-4.7.3-1", f"{what} must be at least one character long")
    if "\x00" in topic:
        raise InvalidTopic("MQTT-4.7.3-2", f"{what} must not contain U+0000: {topic!r}")
    if topic.isascii():
        if len(topic) > _MAX_TOPIC_BYTES:
            raise InvalidTopic("MQTT-4.7.3-3", f"{what} longer than 65535 bytes")
        return
    try:
        size = len(topic.encode("utf-8"))
    except UnicodeEncodeError:
        # Only a lone surrogate gets here; it cannot be sent as well-formed UTF-8.
        raise InvalidTopic("MQTT-1.5.3-1", f"{what} is not well-formed UTF-8: {topic!r}") from None
    if size > _MAX_TOPIC_BYTES:
        raise InvalidTopic("MQTT-4.7.3-3", f"{what} longer than 65535 bytes ({size})")


def validate_topic_name(topic: str) -> None:
    """Raise ``InvalidTopic`` unless ``topic`` may appear in a PUBLISH (or as a will topic)."""
    if "+" in topic or "#" in topic:
        raise InvalidTopic("MQTT-3.3.2-2", f"topic name must not contain wildcards: {topic!r}")
    _check_common(topic, "topic name")


def validate_topic_filter(topic_filter: str) -> None:
    """Raise ``InvalidTopic`` unless ``topic_filter`` may appear in a SUBSCRIBE/UNSUBSCRIBE."""
    _check_common(topic_filter, "topic filter")
    if "+" not in topic_filter and "#" not in topic_filter:
        return
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level:
            if level != "#" or i != last:
                raise InvalidTopic(
                    "MQTT-4.7.1-2",
                    f"'#' must occupy a whole level and be the last one: {topic_filter!r}",
                )
        elif "+" in level and level != "+":
            raise InvalidTopic("MQTT-4.7.1-3", f"'+' must occupy a whole level: {topic_filter!r}")


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Reference matcher: does a (valid) filter match a (valid) topic name?

    Deliberately simple; it is the model the trees are tested against.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False  # [MQTT-4.7.2-1]
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True  # also matches the parent: 'a/#' matches 'a'
        if i >= len(topic_levels):
            return False
        if level != "+" and level != topic_levels[i]:
            return False
    return len(filter_levels) == len(topic_levels)


class _TrieNode(Generic[K, V]):
    # ``plus`` and ``hash`` duplicate children["+"] and children["#"]: the match walk reads
    # them as slots instead of two dict lookups per node and level.
    __slots__ = ("children", "entries", "hash", "plus")

    def __init__(self) -> None:
        self.children: dict[str, _TrieNode[K, V]] = {}
        self.entries: dict[K, V] = {}
        self.plus: _TrieNode[K, V] | None = None
        self.hash: _TrieNode[K, V] | None = None


class TopicTrie(Generic[K, V]):
    """Subscriptions: topic filter -> {key: value}, matched against published topic names.

    A key subscribed through two overlapping filters is reported once per filter; the caller
    decides how to aggregate (MQTT allows either one delivery at the maximum QoS or one per
    subscription [MQTT-3.3.5-1]).
    """

    __slots__ = ("_root", "_size")

    def __init__(self) -> None:
        self._root: _TrieNode[K, V] = _TrieNode()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, topic_filter: str, key: K, value: V) -> bool:
        """Subscribe ``key``; returns True if new, False if it only replaced the value.

        A repeated SUBSCRIBE for the same filter replaces the existing subscription
        [MQTT-3.8.4-3], hence replace rather than reject.
        """
        validate_topic_filter(topic_filter)
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _TrieNode()
                if level == "+":
                    node.plus = child
                elif level == "#":
                    node.hash = child
            node = child
        is_new = key not in node.entries
        node.entries[key] = value
        if is_new:
            self._size += 1
        return is_new

    def remove(self, topic_filter: str, key: K) -> bool:
        """Unsubscribe ``key`` from exactly this filter; False if it was not subscribed."""
        path: list[tuple[_TrieNode[K, V], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if key not in node.entries:
            return False
        del node.entries[key]
        self._size -= 1
        # Prune from the leaf upwards so that dead branches do not slow down later walks.
        while path and not node.entries and not node.children:
            parent, level = path.pop()
            del parent.children[level]
            if level == "+":
                parent.plus = None
            elif level == "#":
                parent.hash = None
            node = parent
        return True

    def get(self, topic_filter: str) -> dict[K, V]:
        """Subscribers of exactly this filter (a copy)."""
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return {}
            node = child
        return dict(node.entries)

    def match(self, topic: str) -> list[tuple[K, V]]:
        """One ``(key, value)`` per matching (filter, key) pair for a topic name."""
        result: list[tuple[K, V]] = []
        root = self._root
        levels = topic.split("/")
        # Level 0 is unrolled because only there do wildcards have to skip '$' topics.
        frontier: list[_TrieNode[K, V]] = []
        first = levels[0]
        if not first.startswith("$"):
            if root.hash is not None:
                result.extend(root.hash.entries.items())
            if root.plus is not None:
                frontier.append(root.plus)
        child = root.children.get(first)
        if child is not None:
            frontier.append(child)
        for level in levels[1:]:
            if not frontier:
                return result
            next_frontier: list[_TrieNode[K, V]] = []
            for node in frontier:
                if node.hash is not None:
                    result.extend(node.hash.entries.items())
                if node.plus is not None:
                    next_frontier.append(node.plus)
                child = node.children.get(level)
                if child is not None:
                    next_frontier.append(child)
            frontier = next_frontier
        for node in frontier:
            if node.entries:
                result.extend(node.entries.items())
            if node.hash is not None:  # 'a/#' also matches 'a' itself
                result.extend(node.hash.entries.items())
        return result

    def match_keys(self, topic: str) -> set[K]:
        """Distinct keys with at least one matching filter."""
        return {key for key, _ in self.match(topic)}

    def match_max(self, topic: str) -> dict[K, V]:
        """Key -> largest value over its matching filters (one delivery at the maximum QoS)."""
        best: dict[K, V] = {}
        for key, value in self.match(topic):
            current = best.get(key)
            if current is None or value > current:  # type: ignore[operator]
                best[key] = value
        return best

    def filters(self) -> Iterator[str]:
        """Every filter with at least one subscriber (order unspecified)."""
        stack: list[tuple[_TrieNode[K, V], tuple[str, ...]]] = [
            (child, (level,)) for level, child in self._root.children.items()
        ]
        while stack:
            node, path = stack.pop()
            if node.entries:
                yield "/".join(path)
            stack.extend((child, (*path, level)) for level, child in node.children.items())

    def items(self) -> Iterator[tuple[str, K, V]]:
        """Every ``(filter, key, value)`` entry, e.g. for snapshotting."""
        stack: list[tuple[_TrieNode[K, V], tuple[str, ...]]] = [
            (child, (level,)) for level, child in self._root.children.items()
        ]
        while stack:
            node, path = stack.pop()
            if node.entries:
                topic_filter = "/".join(path)
                for key, value in list(node.entries.items()):
                    yield topic_filter, key, value
            stack.extend((child, (*path, level)) for level, child in node.children.items())


_MISSING: object = object()


class _IndexNode(Generic[V]):
    __slots__ = ("children", "topic", "value")

    def __init__(self) -> None:
        self.children: dict[str, _IndexNode[V]] = {}
        # The full topic is kept on the node so matching never rebuilds strings.
        self.topic: str = ""
        self.value: V | object = _MISSING


class TopicIndex(Generic[V]):
    """Concrete topic name -> value (retained messages), matched against topic filters."""

    __slots__ = ("_dollar_size", "_root", "_size")

    def __init__(self) -> None:
        self._root: _IndexNode[V] = _IndexNode()
        self._size = 0
        self._dollar_size = 0

    def __len__(self) -> int:
        return self._size

    def count_outside_dollar(self) -> int:
        """How many topics a ``#`` filter matches (those not starting with ``$``), in O(1):
        the count is kept on every set and discard, because walking the whole index to
        count it stalled the event loop for ~0.1 s per 250,000 topics, every $SYS tick."""
        return self._size - self._dollar_size

    def __contains__(self, topic: object) -> bool:
        return isinstance(topic, str) and self._find(topic) is not None

    def _find(self, topic: str) -> _IndexNode[V] | None:
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                return None
            node = child
        return node if node.value is not _MISSING else None

    def set(self, topic: str, value: V) -> None:
        """Store ``value`` under a topic name, replacing any previous one."""
        validate_topic_name(topic)
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _IndexNode()
            node = child
        if node.value is _MISSING:
            self._size += 1
            if topic.startswith("$"):
                self._dollar_size += 1
        node.topic = topic
        node.value = value

    def get(self, topic: str, default: V | None = None) -> V | None:
        node = self._find(topic)
        return default if node is None else node.value  # type: ignore[return-value]

    def discard(self, topic: str) -> bool:
        """Remove a topic's value; True if there was one.  Prunes emptied nodes."""
        path: list[tuple[_IndexNode[V], str]] = []
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if node.value is _MISSING:
            return False
        node.value = _MISSING
        node.topic = ""
        self._size -= 1
        if topic.startswith("$"):
            self._dollar_size -= 1
        while path and node.value is _MISSING and not node.children:
            parent, level = path.pop()
            del parent.children[level]
            node = parent
        return True

    def items(self) -> Iterator[tuple[str, V]]:
        """Every stored ``(topic, value)`` (a snapshot: safe to mutate while iterating)."""
        return iter(self._collect_subtree(self._root, skip_dollar=False))

    def match(self, topic_filter: str) -> Iterator[tuple[str, V]]:
        """Every stored ``(topic, value)`` whose topic matches a (valid) filter.

        The result is gathered before it is returned, so the caller may await or modify the
        index while consuming it (a retained-message replay often does both).
        """
        levels = topic_filter.split("/")
        depth_end = len(levels)
        found: list[tuple[str, V]] = []
        stack: list[tuple[_IndexNode[V], int]] = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            if depth == depth_end:
                if node.value is not _MISSING:
                    found.append((node.topic, node.value))  # type: ignore[arg-type]
                continue
            level = levels[depth]
            if level == "#":
                found.extend(self._collect_subtree(node, skip_dollar=depth == 0))
            elif level == "+":
                for name, child in node.children.items():
                    if depth == 0 and name.startswith("$"):
                        continue  # [MQTT-4.7.2-1]
                    stack.append((child, depth + 1))
            else:
                child = node.children.get(level)
                if child is not None:
                    stack.append((child, depth + 1))
        return iter(found)

    @staticmethod
    def _collect_subtree(start: _IndexNode[V], skip_dollar: bool) -> list[tuple[str, V]]:
        """Values at ``start`` and below (``#`` includes the parent level itself)."""
        found: list[tuple[str, V]] = []
        stack = [start]
        if skip_dollar:
            # Only reachable for a filter that starts with '#': the root holds no value.
            stack = [child for name, child in start.children.items() if not name.startswith("$")]
        while stack:
            node = stack.pop()
            if node.value is not _MISSING:
                found.append((node.topic, node.value))  # type: ignore[arg-type]
            stack.extend(node.children.values())
        return found
