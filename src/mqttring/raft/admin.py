"""Operator commands over the cluster RPC: ``mqttring status``, ``leave`` and ``pin``.

Both authenticate with the cluster secret like any member (``--secret`` or
``$MQTTRING_CLUSTER_SECRET``), so the admin port is the cluster port and nothing more is
exposed.  ``status`` asks one node for its view: that is the node's own applied state,
which is what an operator needs to see when nodes disagree (a lagging or partitioned node
shows an older epoch, and no leader).  Without a Raft majority nothing commits, so the member
states it shows are frozen at the last commit: ``quorum`` says whether the node can prove it
is in the majority's view now.  ``leave`` makes the node hand its shards away, leave Raft and
exit; the command waits (bounded) until the node's cluster port closes.  Errors are one line;
``--node`` at another port of a node (MQTT, HTTP, TLS listeners, Raft) says what answered
there instead (``admin_call``, ``port_probe``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import sys
from functools import partial
from typing import Any

import trio

from mqttring.cluster_tls import add_client_arguments, client_context_from_args
from mqttring.config import ConfigError, parse_hostport
from mqttring.config_fields import positive_seconds
from mqttring.errors import describe_error
from mqttring.raft.port_probe import identify
from mqttring.rpc import (
    RPC_KEY_PURPOSE,
    SECRET_ENV,
    AuthError,
    ProtocolError,
    RpcClient,
    RpcError,
    derive_key,
)


class WrongAddress(Exception):
    """``--node`` did not answer like a node's cluster address: it answered like another
    kind of listener (``port_probe``), or with nothing; the message says what it got and
    what was expected."""


#: What a failed call may raise; each becomes one ``error: HOST:PORT: ...`` line.
CALL_ERRORS = (OSError, EOFError, AuthError, RpcError, trio.TooSlowError, ProtocolError,
               WrongAddress)
#: Seconds without the cluster handshake before ``admin_call`` asks what listens there.
PROBE_AFTER = 1.0
#: Seconds ``leave`` waits for the node's cluster port to close once it has left.
EXIT_WAIT = 20.0


def _key(args: argparse.Namespace) -> bytes:
    secret = args.secret or os.environ.get(SECRET_ENV)
    if not secret:
        raise SystemExit(f"error: give --secret or set ${SECRET_ENV}")
    return derive_key(secret, RPC_KEY_PURPOSE)


def check_node(address: str) -> None:
    """``SystemExit(2)`` after one ``error:`` line if ``--node`` is no address to connect to
    (``nohost``, ``127.0.0.1:99999``, ``[::1]`` without a port, port 0): a usage error,
    before any secret or certificate is read."""
    try:
        _, port = parse_hostport(address)
        if port == 0:
            raise ConfigError(f"port 0 is no address to connect to in {address!r}")
    except ConfigError as exc:
        print(f"error: --node: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _call(args: argparse.Namespace, kind: str, body: dict[str, Any], timeout: float) -> Any:
    check_node(args.node)
    try:
        tls = client_context_from_args(args)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    return trio.run(partial(admin_call, args.node, _key(args), kind, body, timeout, tls=tls,
                            command=args.command_name))


async def admin_call(address: str, key: bytes, kind: str, body: dict[str, Any],
                     timeout: float, *, tls: ssl.SSLContext | None = None,
                     command: str = "status") -> dict[str, Any]:
    """``call_once`` for an operator's command, which says so when ``address`` is not a
    node's cluster address: a ``WrongAddress`` naming what answered there instead.

    While the cluster handshake has not completed ``PROBE_AFTER`` seconds after the start
    (a node's cluster address answers at once: it speaks first), ``port_probe.identify``
    asks, on other connections, whether an MQTT, HTTP or TLS listener is there; and once
    more after a handshake that failed.  The request itself is only ever sent to an address
    that completed the handshake.
    """
    deadline = trio.current_time() + timeout
    outcome: dict[str, Any] = {}

    async def connect(done: trio.CancelScope) -> None:
        try:
            with trio.fail_at(deadline):
                outcome["client"] = await RpcClient.connect(address, key, "admin", timeout,
                                                            tls=tls)
        except Exception as exc:  # re-raised below, outside the nursery (not in a group)
            outcome["error"] = exc
        done.cancel()

    async def probe_early(done: trio.CancelScope) -> None:
        await trio.sleep(min(PROBE_AFTER, timeout / 2))
        outcome["probed"] = what = await identify(address, tls=tls is None)
        if what is not None:
            outcome.setdefault("wrong", what)
            done.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(connect, nursery.cancel_scope)
        nursery.start_soon(probe_early, nursery.cancel_scope)
    client: RpcClient | None = outcome.get("client")
    if client is None:
        error: BaseException | None = outcome.get("error")
        what = outcome.get("wrong")
        # What another listener gives: silence, a close, bytes that are no frame, or (with
        # cluster TLS) a failed TLS handshake.  Refused or unreachable: nothing to ask.
        other = isinstance(error, EOFError | ProtocolError | trio.TooSlowError | AuthError)
        if what is None and other and "probed" not in outcome:
            what = await identify(address, tls=tls is None)
        if what is not None:
            raise WrongAddress(f"answered like {what}; `mqttring {command}` talks to a "
                               f"node's cluster address (--cluster)")
        if isinstance(error, trio.TooSlowError):  # not "is a Raft majority reachable?"
            raise WrongAddress(f"accepted the connection but sent no cluster handshake in "
                               f"{timeout:g} s: is it a node's cluster address (--cluster), "
                               f"not its Raft port or another service?")
        assert error is not None
        raise error
    try:
        with trio.fail_at(deadline):
            return await client.call(kind, body, timeout)
    finally:
        await client.aclose()


def _error(args: argparse.Namespace, exc: BaseException) -> int:
    print(f"error: {args.node}: {describe_error(exc)}", file=sys.stderr)
    return 1


def format_status(status: dict[str, Any]) -> str:
    view, raft = status["view"], status["raft"]
    quorum = status.get("quorum")
    lines = [
        f"node:      {status['node_id']}",
        "quorum:    " + ("yes" if quorum else "unknown (older node)" if quorum is None else
                         "NO: this node cannot reach a Raft majority; nothing commits, and "
                         "the member states below are its last known view"),
        f"leader:    {view['leader'] or '(none known)'}",
        f"term:      {raft.get('term')}",
        f"epoch:     {view['epoch']}",
        f"shards:    {view['num_shards']} x R={view['replication']}",
        "",
        f"{'member':<16} {'state':<9} {'inc':>4} {'owner':>6} {'replica':>8} {'catchup':>8}"
        "  cluster / raft / mqtt",
    ]
    counts = view["shard_counts"]
    for node, m in sorted(view["members"].items()):
        c = counts.get(node, {"owner": 0, "replica": 0, "catching_up": 0})
        lines.append(f"{node:<16} {m['state']:<9} {m['incarnation']:>4} {c['owner']:>6} "
                     f"{c['replica']:>8} {c['catching_up']:>8}  "
                     f"{m['cluster']} / {m['raft']} / {m['mqtt'] or '-'}")
    if view["pins"]:
        lines.append("")
        lines += [f"pin {subtree}/# -> shard {shard}" for subtree, shard in view["pins"].items()]
    stats = status.get("stats")
    if stats:
        m = stats["metrics"]
        lines += [
            "",
            f"traffic of {stats['node_id']}:",
            f"  clients connected      {m['clients_connected']}",
            f"  publishes received     {m['messages_received']}",
            f"  forwarded to owners    {m['forwarded_to_owner']}",
            f"  deliveries to nodes    {m['deliveries_to_nodes']}",
            f"  deliveries to clients  {m['messages_sent']}",
            f"  dropped                {m['messages_dropped']}",
        ]
        for peer, link in sorted(stats.get("links", {}).items()):
            lines.append(f"  link -> {peer:<12} sent {link['sent']} in {link['frames']} frames, "
                         f"queued {link['queued']}, dropped {link['dropped']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status = _call(args, "status", {}, args.timeout)
    except CALL_ERRORS as exc:
        return _error(args, exc)
    # A broker node also reports its traffic counters (a metadata-only member does not).
    with contextlib.suppress(RpcError):
        status["stats"] = _call(args, "stats", {}, args.timeout)
    if args.json:
        if not args.shards:
            status["view"].pop("shards", None)
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    try:
        if args.member:
            _call(args, "remove", {"node_id": args.member}, args.timeout)
            print(f"{args.member} removed")
            return 0
        reply = _call(args, "leave", {}, args.timeout)
    except CALL_ERRORS as exc:
        return _error(args, exc)
    print(f"{args.node} left the cluster (epoch {reply.get('epoch', '?')}); it is stopping",
          flush=True)
    if trio.run(_wait_closed, args.node, EXIT_WAIT):
        print(f"{args.node} stopped")
        return 0
    print(f"error: {args.node}: left, but still accepting connections {EXIT_WAIT:.0f} s later",
          file=sys.stderr)
    return 1


async def _wait_closed(address: str, timeout: float) -> bool:
    """True once nothing accepts connections at ``address`` (the node has exited)."""
    host, _, port = address.rpartition(":")
    with trio.move_on_after(timeout):
        while True:
            try:
                stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
            except OSError:
                return True
            await stream.aclose()
            await trio.sleep(0.1)
    return False


def cmd_pin(args: argparse.Namespace) -> int:
    try:
        if args.unpin:
            reply = _call(args, "unpin", {"subtree": args.subtree}, args.timeout)
            print(f"{args.subtree} unpinned (epoch {reply['epoch']})")
        else:
            reply = _call(args, "pin", {"subtree": args.subtree, "shard": args.shard},
                          args.timeout)
            print(f"{args.subtree} -> shard {reply['shard']} (epoch {reply['epoch']})")
    except CALL_ERRORS as exc:
        return _error(args, exc)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", required=True, metavar="HOST:PORT", help="a member's cluster address")
    p.add_argument("--secret", help=f"cluster secret (else ${SECRET_ENV})")
    p.add_argument("--timeout", type=positive_seconds, default=10.0)
    add_client_arguments(p)


def register(subparsers: Any) -> None:
    status = subparsers.add_parser("status", help="leader, term, epoch, members, shard counts")
    _common(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--shards", action="store_true", help="with --json: the full shard map")
    status.set_defaults(func=cmd_status, command_name="status")
    leave = subparsers.add_parser("leave", help="make a node hand its shards away and leave")
    _common(leave)
    leave.add_argument("--member", help="instead remove this (dead) member through --node")
    leave.set_defaults(func=cmd_leave, timeout=60.0, command_name="leave")
    pin = subparsers.add_parser("pin", help="keep a topic subtree (a/b/#) on one shard")
    _common(pin)
    pin.add_argument("subtree", help="e.g. factory/line1/#")
    pin.add_argument("--shard", type=int, help="shard to pin to (default: hash of the subtree)")
    pin.add_argument("--unpin", action="store_true", help="remove the pin instead")
    pin.set_defaults(func=cmd_pin, command_name="pin")
