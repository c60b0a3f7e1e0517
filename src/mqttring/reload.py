"""What a SIGHUP reload may change in a running node, and when each change takes effect.

A reload reads the config file again (with the same command-line flags on top, so a flag
still wins) and compares it with the running config.  ``plan_reload`` is a pure function
over the two values: it returns the config to run with (the old one, with the live settings
of the new one) and says which changes were applied and which need a restart.  The node
process logs one line per change (``mqttring.lifecycle``) and hands the config to the broker
(``BrokerNode.apply_settings``); nothing is half-applied: a file that fails validation
changes nothing.

Extending it (TLS certificates, say): add the setting to ``LIVE_SETTINGS`` with the moment
it takes effect, and apply it in ``BrokerNode.apply_settings``.  A setting naming a file
whose *content* may change under the same path is re-read on every reload, not only when the
path changed: the password and ACL files are (``BrokerNode.reload_files``, which calls
``BrokerCore.reload_security``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from mqttring.config import BrokerConfig

#: Setting -> when a reloaded value takes effect.  Everything else needs a restart.
LIVE_SETTINGS: dict[str, str] = {
    "log_level": "at once",
    "password_file": "at the next CONNECT; connected clients it would not let in are "
                     "closed at once (docs/security.md, Reload)",
    "allow_anonymous": "at the next CONNECT; connected clients it would not let in are "
                       "closed at once (docs/security.md, Reload)",
    "auth_failures_allowed": "at the next CONNECT (failure counts start afresh)",
    "auth_failure_window": "at the next CONNECT (failure counts start afresh)",
    "acl_file": "at once, for connected clients too (docs/security.md, Reload)",
    "limits.max_connections": "at the next CONNECT",
    "limits.max_subscriptions": "at the next SUBSCRIBE",
    "limits.connect_timeout": "for connections accepted after the reload",
    "limits.publish_window": "for connections accepted after the reload",
    "limits.publish_window_bytes": "for connections accepted after the reload",
    "limits.max_keepalive": "for connections accepted after the reload",
    "limits.topic_alias_maximum_out": "for connections accepted after the reload",
    "limits.max_user_properties": "for connections accepted after the reload",
    "response_information": "for connections accepted after the reload",
    "limits.max_inflight": "for sessions created after the reload",
    "limits.max_queued": "for sessions created after the reload",
    "limits.max_outgoing_buffer": "for sessions created after the reload",
    "limits.queued_message_ttl": "for sessions created after the reload",
    "limits.qos2_dedup_window": "for sessions created after the reload",
}


@dataclass(frozen=True, slots=True)
class Change:
    name: str
    old: Any
    new: Any

    def describe(self) -> str:
        """``limits.max_inflight 32 -> 64`` (paths as strings)."""
        old, new = (str(v) if isinstance(v, Path) else v for v in (self.old, self.new))
        return f"{self.name} {old!r} -> {new!r}"


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    #: The running config with the new live settings: what the node runs with from now on.
    config: BrokerConfig
    applied: tuple[Change, ...]
    #: Settings that differ in the file but only take effect after a restart.
    needs_restart: tuple[str, ...]


def settings(config: BrokerConfig) -> dict[str, Any]:
    """Every setting by name, ``limits`` and ``store`` flattened (``limits.max_inflight``)."""
    flat: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in ("limits", "store"):
            flat.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in fields(value)})
        else:
            flat[f.name] = value
    return flat


def plan_reload(old: BrokerConfig, new: BrokerConfig) -> ReloadPlan:
    before, after = settings(old), settings(new)
    changed = [name for name in before if before[name] != after[name]]
    applied = tuple(Change(n, before[n], after[n]) for n in changed if n in LIVE_SETTINGS)
    top = {c.name: c.new for c in applied if "." not in c.name}
    limits = {c.name.partition(".")[2]: c.new for c in applied if c.name.startswith("limits.")}
    config = replace(old, **top, limits=replace(old.limits, **limits)) if applied else old
    return ReloadPlan(config, applied, tuple(n for n in changed if n not in LIVE_SETTINGS))


__all__ = ["LIVE_SETTINGS", "Change", "ReloadPlan", "plan_reload", "settings"]
