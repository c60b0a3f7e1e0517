"""Request bodies of the wrong shape on the cluster RPC port: refused, never a crash.

A peer holding the cluster secret that sent a list, a string, an int, or a map with wrong
value types as a request body had the handlers fail with AttributeError, TypeError,
KeyError or ValueError, logged as ``RPC handler 'X' failed`` with a traceback (35 of 48
probes).  A ``kind`` that was a list, or a ``data.link`` stream with a list body, ended in
``cluster connection handler failed`` with a traceback.  Now the dispatch checks the body
(``check_body`` and the kinds' schemas): a request is refused with a ``BadRequest``
saying what is wrong and one warning line; a frame that cannot be dispatched closes the
connection with one warning line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from mqttring.broker.admin import register_admin
from mqttring.cluster.inbound import LinkReceiver
from mqttring.config import BrokerConfig
from mqttring.raft.localcluster import free_port
from mqttring.raft.service import RPC_BODIES, RPC_KINDS, MetadataService
from mqttring.rpc import (
    BadRequest,
    FramedStream,
    Peer,
    RpcClient,
    RpcServer,
    check_body,
    derive_key,
)

pytestmark = pytest.mark.timeout(60)

KEY = derive_key("s", "mqttring-rpc-v1")

#: The bodies of the probe: none of them is what any kind needs.
WRONG_SHAPES: list[tuple[str, Any]] = [
    ("list", [1, 2]), ("str", "x"), ("int", 5),
    ("map-garbage", {"node": 5, "incarnation": "x", "shards": "x", "filter": 1,
                     "client_id": [1], "limit": "a", "after": 3}),
]


# -- check_body, no sockets --------------------------------------------------------------

def test_check_body_accepts_the_right_shape_and_a_missing_body() -> None:
    assert check_body("x", None) == {}
    body = {"node_id": "a", "incarnation": 3, "extra": [1]}
    assert check_body("heartbeat", body, RPC_BODIES["heartbeat"]) is body
    member = {"node_id": "b", "cluster": "127.0.0.1:1", "raft": "127.0.0.1:2", "mqtt": None,
              "weight": 2}
    assert check_body("join", {"member": member}, RPC_BODIES["join"])
    assert check_body("pin", {"subtree": "a/#", "shard": None}, RPC_BODIES["pin"])
    assert check_body("caught_up", {"shards": [0, 1]}, RPC_BODIES["caught_up"])


@pytest.mark.parametrize(("kind", "body", "message"), [
    ("status", [1, 2], "status: the body must be a map, not list"),
    ("status", "x", "must be a map, not str"),
    ("status", 5, "must be a map, not int"),
    ("heartbeat", {}, "heartbeat: 'node_id' is required"),
    ("heartbeat", {"node_id": 5}, "'node_id' must be str, not int"),
    ("heartbeat", {"node_id": "a", "incarnation": "x"}, "'incarnation' must be int, not str"),
    ("heartbeat", {"node_id": "a", "incarnation": True}, "'incarnation' must be int, not bool"),
    ("caught_up", {"shards": "x"}, "'shards' must be list, not str"),
    ("caught_up", {"shards": [1, "2"]}, "'shards' must be a list of int"),
    ("pin", {"subtree": "a/#", "shard": "3"}, "'shard' must be int or null, not str"),
    ("unpin", {"subtree": ["a"]}, "'subtree' must be str, not list"),
    ("join", {"member": "b"}, "'member' must be map, not str"),
    ("join", {"member": {"node_id": "b", "cluster": "h:1"}}, "'member'.raft is required"),
    ("join", {"member": {"node_id": "b", "cluster": "h:1", "raft": "h:2", "weight": "9"}},
     "'member'.weight must be int, not str"),
])
def test_check_body_says_what_is_wrong(kind: str, body: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_body(kind, body, RPC_BODIES.get(kind))


# -- the real dispatch, over sockets -----------------------------------------------------

def assert_one_warning_no_traceback(caplog: pytest.LogCaptureFixture, needle: str) -> None:
    records = [r for r in caplog.records if r.name == "mqttring.rpc"]
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
    assert needle in records[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


async def raw_frames(address: str) -> FramedStream:
    """An authenticated connection on which the test writes frames of its own making."""
    client = await RpcClient.connect(address, KEY, "probe")
    return client._fs


async def request(fs: FramedStream, kind: Any, body: Any) -> dict[str, Any]:
    await fs.send({"t": "req", "id": 7, "kind": kind, "body": body})
    with trio.fail_after(5):
        return await fs.receive()


async def test_every_kind_of_a_node_refuses_wrong_shapes_with_a_reason(
        tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """The metadata kinds (a real ``MetadataService``'s server, Raft never started: a wrong
    shape must be refused before a handler runs) and the admin kinds of a broker node."""
    cfg = BrokerConfig(node_id="solo", data_dir=tmp_path, cluster=f"127.0.0.1:{free_port()}",
                       raft=f"127.0.0.1:{free_port()}", cluster_secret="s")
    service = MetadataService(cfg, tls=None)
    register_admin(service.rpc, SimpleNamespace(config=cfg, core=None))  # type: ignore[arg-type]
    port = await nursery.start(service.rpc.serve, "127.0.0.1:0")
    fs = await raw_frames(f"127.0.0.1:{port}")
    caplog.set_level(logging.WARNING)
    kinds = [k for k in RPC_KINDS if k not in ("info", "leave")] + [
        "clients", "subscriptions", "session_counts", "kick"]
    for kind in kinds:
        for name, body in WRONG_SHAPES:
            if name == "map-garbage" and kind in ("status", "clients", "subscriptions",
                                                  "session_counts", "kick"):
                continue  # their handlers run and judge it (tested below / elsewhere)
            caplog.clear()
            reply = await request(fs, kind, body)  # the same connection throughout
            assert reply["ok"] is False, (kind, name)
            assert reply["error"].startswith(f"{kind}: "), (kind, name, reply)
            assert "internal error" not in reply["error"]
            assert_one_warning_no_traceback(caplog, f"refused RPC {kind!r} from 'probe'")


async def test_a_refused_request_leaves_the_connection_usable(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    server = RpcServer(KEY, "srv")

    async def echo(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return {"n": body["n"] + 1}

    server.register("echo", echo, {"n": RPC_BODIES["heartbeat"]["incarnation"]})
    port = await nursery.start(server.serve, "127.0.0.1:0")
    fs = await raw_frames(f"127.0.0.1:{port}")
    caplog.set_level(logging.WARNING)
    reply = await request(fs, "echo", {"n": "1"})
    assert reply == {"t": "res", "id": 7, "ok": False, "error": "echo: 'n' must be int, not str"}
    assert_one_warning_no_traceback(caplog, "refused RPC 'echo'")
    assert (await request(fs, "echo", {"n": 1}))["body"] == {"n": 2}


async def closed_by_server(fs: FramedStream) -> bool:
    with trio.fail_after(5):
        try:
            await fs.receive()
        except (EOFError, trio.BrokenResourceError):
            return True
    return False


@pytest.mark.parametrize(("frame", "needle"), [
    ({"t": "req", "id": 1, "kind": [1], "body": {}}, "whose kind is list, not a string"),
    ({"t": "stream", "kind": {"a": 1}, "body": {}}, "whose kind is dict, not a string"),
    ({"t": "stream", "kind": "data.link", "body": [1]}, "data.link stream whose body is list"),
    ({"t": "stream", "kind": "data.nope", "body": {}}, "unknown stream kind 'data.nope'"),
    ({"t": "req", "kind": "status", "body": {}}, "request without an id"),
])
async def test_an_undispatchable_frame_closes_the_connection_with_one_warning(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, frame: dict[str, Any],
        needle: str) -> None:
    server = RpcServer(KEY, "srv")
    served: list[Any] = []

    async def link(fs: FramedStream, peer: Peer, body: dict[str, Any]) -> None:
        served.append(body)

    server.register_stream("data.link", link)
    port = await nursery.start(server.serve, "127.0.0.1:0")
    fs = await raw_frames(f"127.0.0.1:{port}")
    caplog.set_level(logging.DEBUG)
    await fs.send(frame)
    assert await closed_by_server(fs)
    await trio.sleep(0.05)
    assert served == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and needle in warnings[0].getMessage(), \
        [r.getMessage() for r in warnings]
    assert all(r.exc_info is None for r in caplog.records)


async def test_link_receiver_refuses_a_body_that_is_not_a_map() -> None:
    """Behind the dispatch, the data link's own check: a list body is a protocol error
    (counted and logged by the links), not an AttributeError."""
    errors: list[str] = []

    def on_protocol_error(node: str, exc: Exception) -> Exception:
        errors.append(str(exc))
        return exc

    receiver = LinkReceiver(lambda node, message: None, lambda *a: True, max_frame=1 << 20,
                            on_answer=lambda ack: None, on_lost=lambda node: None,
                            on_protocol_error=on_protocol_error)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="data link without a session number"):
        await receiver.serve_stream(None, Peer("b", "?"), [1])  # type: ignore[arg-type]
    assert errors == ["data link without a session number: None"]
