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


def test_a_session_stored_while_connected_counts_its_expiry_from_the_load(tmp_path) -> None:
    """The header of a connected session keeps its interval (``cut``); read back after a
    crash, the session ends that long after the load (plus the cluster's grace), one with
    a deadline keeps it, and a never-expiring one stays so."""
    import trio

    from mqttring.broker.session_store import SessionStore
    from mqttring.broker.sessions import cut_expiry
    from mqttring.lsm import LsmStore

    assert cut_expiry(None, 0) == 0, "3.1.1 default: kept until the client returns"
    assert cut_expiry(None, 30) == 30, "limits.persistent_session_expiry"

    async def main() -> None:
        with LsmStore(tmp_path / "s") as lsm:
            store = SessionStore(lsm, 16)
            for cid, cut, ends_at in (("cut", 2, 0.0), ("ends", 2, NOW + 5), ("never", 0, 0.0)):
                session = Session(cid, False)
                session.cut_expiry, session.ends_at = cut, ends_at
                await store.save_subscriptions(session)
            loaded = {r.client_id: r for r in await store.load_all()}
            assert loaded["cut"].cut_expiry == 2
            assert loaded["cut"].to_session(Session("x", False).limits, NOW).ends_at == NOW + 2
            assert loaded["cut"].to_session(Session("x", False).limits, NOW,
                                            grace=15).ends_at == NOW + 17
            assert loaded["ends"].to_session(Session("x", False).limits, NOW).ends_at == NOW + 5
            assert loaded["never"].to_session(Session("x", False).limits, NOW).ends_at == 0.0

    trio.run(main)
