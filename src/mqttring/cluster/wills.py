"""How a home publishes the wills it keeps: now, or once it serves again.

The registrations themselves (which connection of a client id is live, and whose will that
is) are ``mqttring.cluster.sessions``'s, and so is the MQTT 5 Will Delay Interval: a closed
connection keeps its registration until its will falls due, so that the delay survives the
home.  A will reaches this module once it is due.  Two things can stand between that and
the PUBLISH:

* **A fence.**  A node that cannot prove it is in the majority's view publishes no will: it
  owes it (``OwedWill``) and publishes it when it serves again, in this life or the next
  (``publish_owed``).  If the majority declares it down meanwhile, its will keepers publish
  some of those wills themselves; ``on_declared_down`` keeps only the others.
* **A refused publish** (the topic's owner moving): tried three times, a view change apart.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mqttring.broker.refusals import PublishRefused
from mqttring.broker.sessions import will_message
from mqttring.cluster.messages import WillSpec
from mqttring.protocol.packets import Will
from mqttring.protocol.packets5 import Will5
from mqttring.protocol.properties import PropertyId, decode_properties, encode_properties

if TYPE_CHECKING:
    from mqttring.broker.core import BrokerCore

log = logging.getLogger("mqttring.cluster.sessions")


def will_to_wire(will: Will | Will5 | None) -> WillSpec | None:
    """An MQTT 5 will travels with its encoded will properties (the Will Delay Interval in
    them already bounded by the session expiry: ``effective_will``)."""
    if will is None:
        return None
    if type(will) is Will5:
        return WillSpec(will.topic, will.payload, will.qos, will.retain,
                        encode_properties(will.properties, "WILL"), will.delay)
    return WillSpec(will.topic, will.payload, will.qos, will.retain)


def will_from_wire(spec: WillSpec | None) -> Will | Will5 | None:
    """The inverse of ``will_to_wire``; malformed will properties from a peer raise the
    codec's error, which the link treats as a peer protocol error."""
    if spec is None:
        return None
    if spec.props is not None:
        props, _ = decode_properties(spec.props, 0, len(spec.props), "WILL")
        return Will5(spec.topic, spec.payload, spec.qos, spec.retain, props)
    return Will(spec.topic, spec.payload, spec.qos, spec.retain)


def undelayed(will: Will | Will5) -> Will | Will5:
    """``will`` as published once its delay has run: without its Will Delay Interval."""
    if type(will) is Will5:
        return replace(will, properties=will.properties.without(
            PropertyId.WILL_DELAY_INTERVAL))
    return will


@dataclass(frozen=True)
class OwedWill:
    """A will that fell due while this node, its keeper, was fenced.

    With ``token`` set, the registration of connection ``token`` is still held (here, and at
    the replicas, which were not told it ended): ending it later publishes the will at
    whichever node is then the home.  Without, the registration is gone everywhere (a
    takeover, a will delay that ran out) and only this node knows of it.
    """

    client_id: str
    will: Will | Will5
    reason: str
    #: Its client's username: the ACL is asked again when it goes out.
    username: str | None = None
    #: The registration still held: its connection's token, and the node it was on.
    token: str | None = None
    edge: str | None = None


class Wills:
    """The publishing side of one node's will keeping (see the module docstring)."""

    def __init__(self, node_id: str, core: BrokerCore, spawn: Callable[..., None],
                 fenced: Callable[[], bool],
                 wait_for_view_change: Callable[[float], Awaitable[None]],
                 end_registration: Callable[[str, str, bool], Awaitable[None]]) -> None:
        self.node_id = node_id
        self.core = core
        self.spawn = spawn
        self.fenced = fenced
        self.wait_for_view_change = wait_for_view_change
        #: Ends a registration wherever the view puts its home, publishing its will there.
        self.end_registration = end_registration
        #: Wills due while fenced: published once this node serves again
        #: (``on_declared_down`` says which survive a declaration of this node's death).
        self.owed: list[OwedWill] = []

    def publish(self, client_id: str, will: Will | Will5 | None, reason: str,
                username: str | None = None) -> None:
        """Publish a will that is due (its delay, if any, has run), or owe it if fenced."""
        if will is None:
            return
        if self.fenced():
            self.owe(OwedWill(client_id, will, reason, username))
            return
        if not self.core.shutting_down and self.core.will_allowed(username, client_id, will):
            # Every will says why it went out: an operator asking "why did my device's will
            # fire?" finds the answer in the log of its home.
            log.info("publishing the will of %r on %r: %s", client_id, will.topic, reason,
                     extra={"client_id": client_id, "event": "will"})
            self.core.metrics.messages_received += 1
            # In a task: a will waits for its topic's owner like any publish (through a
            # failover, say), and neither the lock held here nor a view change may wait.
            self.spawn(self._publish_now, will)

    def owe(self, owed: OwedWill) -> None:
        log.info("will of %r owed (%s); held while fenced", owed.client_id, owed.reason)
        self.owed.append(owed)

    async def _publish_now(self, will: Will | Will5) -> None:
        message = will_message(will, "")
        for attempt in range(3):
            try:
                await self.core.router.publish(message)
                return
            except PublishRefused as exc:
                log.warning("will on %r not accepted (%s), attempt %d", will.topic, exc,
                            attempt + 1)
                await self.wait_for_view_change(1.0)
        log.error("will on %r dropped after 3 refusals", will.topic)

    def publish_owed(self) -> None:
        """Back in the view (in this life or the next): publish what fell due meanwhile."""
        wills, self.owed = self.owed, []
        for owed in wills:
            reason = f"{owed.reason}; owed while this node was fenced"
            if owed.token is None:
                self.publish(owed.client_id, owed.will, reason, owed.username)
            else:
                # Wherever the registration is now: here (then it ends and its replicas are
                # told), or at the home the view moved it to.  A client that connected again
                # meanwhile took it over (publishing the will): the token no longer matches.
                self.spawn(self.end_registration, owed.client_id, owed.token, True)

    def on_declared_down(self) -> None:
        """Declared down while fenced: keep the owed wills nobody else will publish.

        The will keepers of the majority still hold the registrations this node kept, and
        publish the wills of those whose edge left the view: this node's own connections.
        The others' edges live on, so their registrations there look current: this node
        ends them once it serves again in its next life (late, not lost).  A will whose
        registration is gone everywhere is known here only: kept too.
        """
        me = self.node_id
        self.owed = [owed for owed in self.owed if owed.token is None or owed.edge != me]


__all__ = ["OwedWill", "Wills", "undelayed", "will_from_wire", "will_to_wire"]
