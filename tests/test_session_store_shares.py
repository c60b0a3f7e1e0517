"""A shared subscription's copy queued for a persistent session stays a share's copy when
the session is loaded again (after a restart, or at its next home in a cluster).

The stored row kept the message and not its share, so the copy came back as an ordinary
message: sent with the Subscription Identifiers of the client's ordinary subscriptions
(or none) instead of the share's [MQTT-3.3.4-3], and, if the session then ended with it
unacknowledged, not handed back to the share's other members.  A real ``LsmStore``.
"""

from __future__ import annotations

from pathlib import Path

from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter
from mqttring.broker.shared import SharedMessage
from mqttring.lsm import Durability, LsmStore
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session, SessionLimits

NUM_SHARDS = 8


async def test_a_share_copy_is_loaded_back_as_a_copy_of_its_share(tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS, LocalShardWriter(lsm))
        session = Session("member", False)
        session.subscriptions["$share/g/jobs/+"] = 1
        session.subscriptions["jobs/#"] = 1
        await store.save_subscriptions(session, list(session.subscriptions))
        session.deliver(SharedMessage(Message("jobs/1", b"shared", 1), "$share/g/jobs/+"), 1)
        session.deliver(Message("jobs/1", b"ordinary", 1, mid=7), 1)
        await store.save_changes([session], Durability.DURABLE)

        [stored] = await store.load_all()
        loaded = stored.to_session(SessionLimits())
        copies = {e.message.payload: e.message for e in loaded.queue}
        assert type(copies[b"shared"]) is SharedMessage
        assert copies[b"shared"].share == "$share/g/jobs/+"  # type: ignore[attr-defined]
        assert type(copies[b"ordinary"]) is Message and copies[b"ordinary"].mid == 7
