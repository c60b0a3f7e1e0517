"""MQTT 5 session expiry on the broker side (``broker.sessions.LocalSessions``): the sweep
that ends offline sessions whose wall-clock deadline passed."""

from __future__ import annotations

from mqttring.protocol.session import Session

NOW = 1_800_000_000.0


def test_expired_sessions_are_swept() -> None:
    """``LocalSessions.expire_sessions``: an offline session past its wall-clock deadline
    ends (routes, memory, store); one still in time, or connected, stays."""
    import trio

    from mqttring.broker.core import BrokerCore
    from mqttring.broker.metrics import BrokerMetrics
    from mqttring.broker.retained import RetainedStore
    from mqttring.broker.router import LocalRouter
    from mqttring.broker.session_store import SessionStore
    from mqttring.config import BrokerConfig

    store = SessionStore(None, 16)
    core = BrokerCore(BrokerConfig(), store, BrokerMetrics(),
                      lambda core: LocalRouter(core.sessions, RetainedStore(None, 16), store,
                                               core.metrics, lambda client_id: None))

    async def main() -> None:
        for cid, ends_at, online in (("gone", NOW - 1, False), ("kept", NOW + 60, False),
                                     ("never", 0.0, False), ("online", NOW - 1, True)):
            session = Session(cid, False)
            session.ends_at = ends_at
            if online:
                session.attach(bytearray())
            core.sessions[cid] = session
            core.router.subscribe_now(session, f"{cid}/#", 1)
        assert await core.manager.expire_sessions(NOW) == 1
        assert sorted(core.sessions) == ["kept", "never", "online"]
        assert not core.router.subscriptions.get("gone/#")  # type: ignore[attr-defined]

    trio.run(main)
