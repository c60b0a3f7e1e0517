"""MetadataService in this process: a one-node cluster on real pysyncobj and sockets."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from mqttring.config import BrokerConfig, ConfigError
from mqttring.raft.localcluster import free_port
from mqttring.raft.service import CatchUp, MetadataService, default_raft_address
from mqttring.raft.view import MemberState, ShardState

pytestmark = pytest.mark.timeout(60)


def config(tmp_path: Path, **kw) -> BrokerConfig:
    return BrokerConfig(node_id="solo", mqtt="127.0.0.1:1883", data_dir=tmp_path,
                        cluster=f"127.0.0.1:{free_port()}", raft=f"127.0.0.1:{free_port()}",
                        cluster_secret="s", num_shards=32, replication=2, **kw)


async def test_one_node_cluster_view_subscribe_pin_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    service = MetadataService(cfg, tls=None)
    async with trio.open_nursery() as nursery:
        view = await nursery.start(service.run)
        assert view is service.view()
        assert view.members["solo"].state is MemberState.UP
        assert view.leader == "solo"
        assert all(view.owner(s) == "solo" for s in range(32))
        assert view.shard_state(0) is ShardState.STABLE
        views = service.subscribe()
        result = await service.pin("plant/7/#", 3)
        assert result["shard"] == 3
        with trio.fail_after(5):
            async for pushed in views:
                if pushed.pins:
                    break
        assert pushed.epoch > view.epoch
        assert pushed.shard_for_topic("plant/7/temp") == 3
        assert service.view().shard_for_client("c1") == pushed.shard_for_client("c1")
        nursery.cancel_scope.cancel()
    # Restart from the same data dir: the journal brings the metadata back.
    again = MetadataService(cfg, tls=None)
    async with trio.open_nursery() as nursery:
        view = await nursery.start(again.run)
        with trio.fail_after(5):
            while not again.view().pins:
                await trio.sleep(0.05)
        assert again.view().pins == {"plant/7": 3}
        assert again.view().members["solo"].incarnation == 1
        await again.leave()  # the last member: nothing to hand over, returns at once
        nursery.cancel_scope.cancel()


def listening_ipv4(port: int) -> set[str]:
    """Addresses listening on ``port``, read from /proc/net/tcp (not psutil: pysyncobj
    replaces ``socket.inet_ntop`` in every process that imports it, which breaks psutil's
    address decoding)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


async def test_raft_listens_only_on_the_address_it_is_given(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    port = int(cfg.raft.rsplit(":", 1)[1])  # type: ignore[union-attr]
    service = MetadataService(cfg, tls=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        listening = listening_ipv4(port)
        assert listening == {"127.0.0.1"}, f"Raft port {port} listens on {listening}"
        nursery.cancel_scope.cancel()


async def test_mark_caught_up_refuses_shards_not_targeted(tmp_path: Path) -> None:
    service = MetadataService(config(tmp_path), tls=None, catch_up=CatchUp.DATA_PLANE)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        result = await service.mark_caught_up([0, 1, 999])
        assert result["accepted"] == 2  # shard 999 does not exist
        nursery.cancel_scope.cancel()


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="cluster_secret"):
        MetadataService(BrokerConfig(cluster="127.0.0.1:7000", raft="127.0.0.1:7001"))
    assert default_raft_address("127.0.0.1:7000") == "127.0.0.1:7001"
    with pytest.raises(ConfigError):
        default_raft_address("127.0.0.1:0")


def test_importing_raft_leaves_socket_inet_ntop_working() -> None:
    import socket

    import mqttring.raft.service  # noqa: F401  (pysyncobj, imported by it, replaces inet_ntop)

    assert socket.inet_ntop(socket.AF_INET, bytes([10, 0, 0, 7])) == "10.0.0.7"
    assert socket.inet_ntop(socket.AF_INET6, bytes(15) + b"\x01") == "::1"


async def test_a_member_that_answers_garbage_is_skipped_for_the_next(tmp_path: Path) -> None:
    """Joining (or rejoining after being marked down) asks each known member in turn: one
    that sends a frame that is not one (``ProtocolError``) is a failed try, and the next
    member answers, rather than the error ending the node."""
    from mqttring.rpc import RpcServer

    service = MetadataService(config(tmp_path), tls=None)

    async def garbage(stream: trio.SocketStream) -> None:
        await stream.send_all(b"\x00\x00\x00\x05not msgpack at all")
        await stream.aclose()

    async def info(body: dict, peer: object) -> dict:
        return {"answered": True}

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, garbage, listeners)
        good = RpcServer(service._rpc_key, "other")
        good.register("info", info)
        port = await nursery.start(good.serve, "127.0.0.1:0")
        service._join_via = [f"127.0.0.1:{listeners[0].socket.getsockname()[1]}",
                             f"127.0.0.1:{port}"]
        with trio.fail_after(10):
            assert await service._first_answer("info", {}) == {"answered": True}
        nursery.cancel_scope.cancel()


async def test_an_admitted_node_whose_replica_hears_nothing_gives_up_in_join_timeout(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A member admits the node, but the cluster's Raft never reaches its replica (here the
    'cluster' is one member whose Raft peer is an address nobody listens on; in life a
    firewall, or a ``--raft`` address the members cannot reach).  The node waited for its
    replica to show it admitted for ever, with no log line; now it logs the wait and gives
    up after ``join_timeout`` with a ``JoinError`` that names its Raft address."""
    import logging

    from mqttring.errors import JoinError, sole_exception
    from mqttring.rpc import RpcServer

    member = RpcServer(MetadataService(config(tmp_path / "m"), tls=None)._rpc_key, "member")
    silent_raft = f"127.0.0.1:{free_port()}"
    joins: list[dict] = []

    async def info(body: dict, peer: object) -> dict:
        return {"raft_peers": [silent_raft]}

    async def join(body: dict, peer: object) -> dict:
        joins.append(body)
        return {"incarnation": 1, "epoch": 7}

    member.register("info", info)
    member.register("join", join)
    caplog.set_level(logging.INFO, logger="mqttring.raft")
    async with trio.open_nursery() as outer:
        port = await outer.start(member.serve, "127.0.0.1:0")
        cfg = config(tmp_path / "n", join=f"127.0.0.1:{port}", join_timeout=5.0)
        service = MetadataService(cfg, tls=None)
        started = trio.current_time()
        with trio.fail_after(20):
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(service.run)
            except BaseException as exc:  # the group trio raises
                error = sole_exception(exc)
            else:
                error = None
        outer.cancel_scope.cancel()
    assert isinstance(error, JoinError), error
    assert len(joins) == 1
    assert f"replica ({cfg.raft})" in str(error) and "join_timeout = 5 s" in str(error)
    assert 4.5 <= trio.current_time() - started < 15
    waits = [r.getMessage() for r in caplog.records if "to receive the cluster's log" in
             r.getMessage()]
    assert waits and "admitted at epoch 7" in waits[0], caplog.text
