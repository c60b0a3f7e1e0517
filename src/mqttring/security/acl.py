"""ACL files in mosquitto's ``acl_file`` format: parse once, decide per client, fast.

Format (mosquitto.conf(5), ``acl_file``), one directive a line, ``#`` comments::

    topic [read|write|readwrite|deny] FILTER     # no access word: readwrite
    user NAME                                    # the topic lines below are NAME's
    pattern [read|write|readwrite|deny] FILTER   # every client; %c client id, %u username

``topic`` lines before the first ``user`` line apply to anonymous clients (no username).
``pattern`` lines apply to every client, anonymous ones included; ``%c`` and ``%u`` must be
a whole topic level, and a pattern naming an identity that contains ``+``, ``#`` or ``/``
(or ``%u`` for an anonymous client) does not apply to that client.

Decisions, as mosquitto 2.x takes them (``acl__check_default``), in two tiers: first the
client's own rules (its ``user`` section, or the anonymous ``topic`` lines), then the
``pattern`` lines, each tier deny first:

* A matching ``deny`` rule of the client's own refuses.
* Otherwise one of its own rules that matches and includes the access asked grants it,
  whatever the patterns say.
* Otherwise the patterns decide the same way: a matching ``deny`` pattern refuses, a
  matching pattern with the access grants.
* Otherwise it is refused: with an ACL file, anything not granted is denied.

So a user's own grant is not undone by a ``pattern deny`` (before 2026-11-29 every deny
refused, whatever granted: a file written for mosquitto gave fewer rights here), and a
user's own ``deny`` is not undone by a pattern's grant.
* Each message is checked against *read* rules just before it reaches a subscriber, so a
  wildcard subscription never brings a topic the client may not read, retained or queued.
* A subscription is checked against *read* rules too: it is refused (SUBACK 0x80) when it
  can match no topic the client may read, i.e. it overlaps no read grant or lies wholly
  inside a ``deny``.  mosquitto 2.0 grants such a subscription and then delivers nothing
  on it; the refusal tells the client at once, and what any subscription delivers is the
  same as there.  ``#`` for a client that may read ``a/+`` is granted and brings ``a/x``
  only.
* ``$``-topics (``$SYS``) are matched only by rules whose filter starts with ``$``.

This module is pure: ``AclFile.parse`` turns text into an immutable value (or an
``AclParseError`` naming the line), ``ClientAccess`` answers for one client with a small
cache.  ``AccessControl`` holds the current file and swaps a new one in on ``reload()``;
every ``ClientAccess`` notices the swap at its next question, so an ACL change reaches
connected clients, their queued messages included.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from mqttring.config import ConfigError

log = logging.getLogger("mqttring.security")

#: Topics whose answer one client remembers (per access kind); cleared when full.
CLIENT_CACHE_SIZE = 512


class AclParseError(ConfigError):
    """An ACL file cannot be read or holds a line that is not a valid directive."""


class Access(enum.IntFlag):
    READ = 1
    WRITE = 2
    READWRITE = 3
    #: An explicit refusal of both, stronger than any grant.
    DENY = 4


_ACCESS_WORDS = {"read": Access.READ, "write": Access.WRITE, "readwrite": Access.READWRITE,
                 "deny": Access.DENY}


@dataclass(frozen=True, slots=True)
class Rule:
    access: Access
    filter: str
    #: Line in the file, for messages.
    line: int = 0


@dataclass(frozen=True, slots=True)
class AclFile:
    """The rules of one file: anonymous clients', each user's, and the patterns."""

    anonymous: tuple[Rule, ...]
    users: Mapping[str, tuple[Rule, ...]]
    patterns: tuple[Rule, ...]

    @classmethod
    def parse(cls, text: str, source: str = "<acl file>") -> AclFile:
        anonymous: list[Rule] = []
        users: dict[str, list[Rule]] = {}
        patterns: list[Rule] = []
        current = anonymous
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            # Words are separated by any whitespace, tabs too: read as spaces only, the
            # line "topic deny<TAB>shared/secret" granted the filter "deny\tshared/secret"
            # instead of denying (a black-box probe; mosquitto 2.0 reads it so too).
            keyword, *tail_words = line.split(None, 1)
            rest = tail_words[0].strip() if tail_words else ""
            where = f"{source}:{number}"
            if keyword == "user":
                if not rest:
                    raise AclParseError(f"{where}: 'user' needs a username")
                current = users.setdefault(rest, [])
            elif keyword in ("topic", "pattern"):
                word, *tail_words = rest.split(None, 1) or [""]
                tail = tail_words[0] if tail_words else ""
                if word in _ACCESS_WORDS:
                    access, topic_filter = _ACCESS_WORDS[word], tail.strip()
                elif tail.strip():
                    # Two words: the first is an access type (as mosquitto reads it), and a
                    # misspelled one must not turn a ``deny`` into a grant of a filter
                    # nobody publishes to ("Deny shared/secret").
                    raise AclParseError(f"{where}: invalid access type {word!r} (expected "
                                        "read, write, readwrite or deny)")
                else:
                    access, topic_filter = Access.READWRITE, rest
                problem = _filter_problem(topic_filter, keyword == "pattern")
                if problem:
                    raise AclParseError(f"{where}: {keyword} {topic_filter!r}: {problem}")
                rule = Rule(access, topic_filter, number)
                (patterns if keyword == "pattern" else current).append(rule)
            else:
                raise AclParseError(f"{where}: unknown directive {keyword!r} (expected "
                                    "'user', 'topic' or 'pattern')")
        return cls(tuple(anonymous),
                   MappingProxyType({u: tuple(r) for u, r in users.items()}), tuple(patterns))

    @classmethod
    def load(cls, path: Path) -> AclFile:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise AclParseError(f"cannot read ACL file {path}: {exc}") from None
        return cls.parse(text, str(path))

    def rules_for(self, username: str | None, client_id: str) -> Compiled:
        """The rules that apply to one client: its own, then the patterns substituted,
        each tier split by kind (see the module docstring for the order)."""
        own = self.anonymous if username is None else self.users.get(username, ())
        mine = [(r.access, tuple(r.filter.split("/"))) for r in own]
        patterns: list[tuple[Access, tuple[str, ...]]] = []
        for rule in self.patterns:
            levels = _substitute(rule.filter, username, client_id)
            if levels is not None:
                patterns.append((rule.access, levels))
        return Compiled((_tier(mine), _tier(patterns)))


def _tier(rules: list[tuple[Access, tuple[str, ...]]]) -> Tier:
    return Tier(tuple(lv for a, lv in rules if a & Access.DENY),
                tuple(lv for a, lv in rules if a & Access.READ),
                tuple(lv for a, lv in rules if a & Access.WRITE))


def _filter_problem(topic_filter: str, pattern: bool) -> str:
    if not topic_filter:
        return "the topic filter is missing"
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return "'#' must be a whole level, and the last"
        if "+" in level and level != "+":
            return "'+' must be a whole level"
        if pattern and ("%c" in level or "%u" in level) and level not in ("%c", "%u"):
            return "%c and %u must be a whole topic level"
    return ""


def _substitute(topic_filter: str, username: str | None,
                client_id: str) -> tuple[str, ...] | None:
    """A pattern's levels for one client; None when it cannot apply to it."""
    levels = topic_filter.split("/")
    out: list[str] = []
    for level in levels:
        if level == "%c":
            value: str | None = client_id
        elif level == "%u":
            value = username
        else:
            out.append(level)
            continue
        if not value or any(c in value for c in "+#/"):
            return None  # mosquitto: such an identity would widen the pattern
        out.append(value)
    return tuple(out)


def matches(levels: tuple[str, ...], topic: str) -> bool:
    """Does a rule's filter match ``topic`` (a topic name, or a subscription filter taken
    literally)?  ``$`` topics only match rules that start with ``$`` [MQTT-4.7.2-1]."""
    parts = topic.split("/")
    if topic.startswith("$") and levels[0] in ("+", "#"):
        return False
    n = len(parts)
    for i, level in enumerate(levels):
        if level == "#":
            return True
        if i >= n or (level != "+" and level != parts[i]):
            return False
    return len(levels) == n


def overlaps(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Is there a topic both filters match?"""
    if (a[0] in ("+", "#") and b[0].startswith("$")) or (
            b[0] in ("+", "#") and a[0].startswith("$")):
        return False
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b):
            rest = a[i:] or b[i:]
            return rest == ("#",)  # "x/#" also matches "x"
        x, y = a[i], b[i]
        if x == "#" or y == "#":
            return True
        if x != y and x != "+" and y != "+":
            return False
    return True


def covers(outer: tuple[str, ...], inner: tuple[str, ...]) -> bool:
    """Does ``outer`` match every topic ``inner`` matches?"""
    if outer[0] in ("+", "#") and inner[0].startswith("$"):
        return False
    for i, level in enumerate(outer):
        if level == "#":
            return True
        if i >= len(inner) or inner[i] == "#":
            return False
        if level != "+" and inner[i] != level:
            return False
    return len(outer) == len(inner)


@dataclass(frozen=True, slots=True)
class Tier:
    """Rules of one tier (a client's own, or the patterns), by what they do."""

    deny: tuple[tuple[str, ...], ...]
    read: tuple[tuple[str, ...], ...]
    write: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class Compiled:
    """One client's rules: its own tier, then the patterns' (module docstring)."""

    tiers: tuple[Tier, ...]

    def allows(self, write: bool, topic: str) -> bool:
        """May the client write (else read) ``topic``?  The first tier with a matching
        rule decides, deny first."""
        for tier in self.tiers:
            if any(matches(levels, topic) for levels in tier.deny):
                return False
            if any(matches(levels, topic) for levels in (tier.write if write else tier.read)):
                return True
        return False

    def may_subscribe(self, topic_filter: str) -> bool:
        """Refused when the first tier that speaks of it denies all of it, or no tier
        grants any of it (module docstring)."""
        levels = tuple(topic_filter.split("/"))
        for tier in self.tiers:
            if any(covers(deny, levels) for deny in tier.deny):
                return False
            if any(overlaps(read, levels) for read in tier.read):
                return True
        return False


class AccessControl:
    """The node's current ACL file (``None``: no ACL, everything open); ``reload()`` reads
    the file again into a new immutable value and swaps it in with one assignment."""

    def __init__(self, path: Path, loaded: AclFile | None = None) -> None:
        """``loaded``: ``path`` already loaded (``mqttring.broker.files``); None: load it."""
        self.path = path
        self.current: AclFile = AclFile.load(path) if loaded is None else loaded

    def reload(self) -> None:
        """Swap in the file as it is now; a file that does not parse leaves the old rules
        in force and raises ``AclParseError``."""
        self.current = AclFile.load(self.path)
        log.info("ACL file %s loaded", self.path)

    def for_client(self, username: str | None, client_id: str) -> ClientAccess:
        return ClientAccess(self, username, client_id)


class ClientAccess:
    """What one client may read, write and subscribe to, answered from a small cache that
    is rebuilt when the node's ACL file is swapped."""

    __slots__ = ("_acl", "_cache", "_client_id", "_holder", "_rules", "_username")

    def __init__(self, holder: AccessControl, username: str | None, client_id: str) -> None:
        self._holder = holder
        self._username = username
        self._client_id = client_id
        self._acl: AclFile | None = None
        self._rules = Compiled(())
        self._cache: dict[tuple[int, str], bool] = {}

    @property
    def username(self) -> str | None:
        return self._username

    def _answer(self, kind: int, topic: str) -> bool:
        acl = self._holder.current
        if acl is not self._acl:
            self._acl = acl
            self._rules = acl.rules_for(self._username, self._client_id)
            self._cache = {}
        key = (kind, topic)
        found = self._cache.get(key)
        if found is None:
            rules = self._rules
            found = rules.may_subscribe(topic) if kind == 3 else rules.allows(kind == 2, topic)
            if len(self._cache) >= CLIENT_CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = found
        return found

    def may_read(self, topic: str) -> bool:
        """May a message on ``topic`` be delivered to this client?"""
        return self._answer(1, topic)

    def may_subscribe(self, topic_filter: str) -> bool:
        """May this client subscribe to ``topic_filter`` (see the module docstring)?"""
        return self._answer(3, topic_filter)

    def may_write(self, topic: str) -> bool:
        """May this client publish on ``topic`` (its will included)?"""
        return self._answer(2, topic)
