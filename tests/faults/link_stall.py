"""A data link stalled in TCP's retransmissions is replaced, and its frames replayed.

Run by ``test_link_stall.py`` inside a network namespace of its own (it installs nftables
rules on that namespace's loopback, which touch nothing else).  Two real ``Links`` with
real RPC servers: node a sends numbered ``SessionKick`` messages to b (sent once, never
acknowledged by the layer above, the kind a lost connection used to lose), then nftables
drops every packet of the link's established connection (``both``), or only b's
acknowledgements of frames (``acks``), and a goes on sending.  The connection stalls; the
stall guard must replace it (a fresh connection: new port, not cut) and replay what was
unacknowledged, so that b applies every message once, in order.
Prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import trio

from mqttring.cluster.links import STREAM_KIND, Links
from mqttring.cluster.messages import SessionKick
from mqttring.rpc import RpcServer, derive_key

KEY = derive_key("stall-test", "mqttring-rpc-v1")
STALL_TIMEOUT = 1.0
BEFORE, DURING = 200, 200


def _link_ports(port_b: int) -> list[int]:
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{port_b} )"],
                         capture_output=True, text=True, check=True, timeout=10).stdout
    return [int(line.split()[2].rsplit(":", 1)[1]) for line in out.splitlines() if line]


def _cut(port_a: int, port_b: int, mode: str) -> None:
    """``both``: every packet of the connection dropped.  ``acks``: only b's segments that
    carry data, its acknowledgements of frames (a pure TCP ACK is 52 bytes of IPv4 with
    timestamps): a's bytes all arrive and a's TCP never needs to retransmit."""
    if mode == "both":
        rules = (f"    tcp sport {port_a} tcp dport {port_b} drop\n"
                 f"    tcp sport {port_b} tcp dport {port_a} drop\n")
    else:
        rules = f"    tcp sport {port_b} tcp dport {port_a} ip length > 52 drop\n"
    script = ("table inet mqstall {\n  chain input { type filter hook input priority 0;\n"
              f"{rules}  }}\n}}\n")
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True, timeout=10)


async def main(mode: str) -> dict[str, Any]:
    got: list[str] = []
    a = Links("a", KEY, lambda node, msg: None, stall_timeout=STALL_TIMEOUT)
    b = Links("b", KEY, lambda node, msg: got.append(msg.client_id))
    async with trio.open_nursery() as nursery:
        servers = []
        for node, links in (("a", a), ("b", b)):
            server = RpcServer(KEY, node)
            port = await nursery.start(server.serve, "127.0.0.1:0")
            server.register_stream(STREAM_KIND, links.serve_stream)
            servers.append(port)
            await nursery.start(links.run)
        a.update_peers({"b": f"127.0.0.1:{servers[1]}"})
        b.update_peers({"a": f"127.0.0.1:{servers[0]}"})
        for i in range(BEFORE):
            a.send_control("b", SessionKick(0, f"m{i}", "x:1"))
        with trio.fail_after(10):
            while len(got) < BEFORE:
                await trio.sleep(0.01)
        ports = await trio.to_thread.run_sync(_link_ports, servers[1])
        if len(ports) != 1:
            raise RuntimeError(f"expected one link connection to b, found ports {ports}")
        await trio.to_thread.run_sync(_cut, ports[0], servers[1], mode)
        cut_at = time.monotonic()
        for i in range(BEFORE, BEFORE + DURING):
            a.send_control("b", SessionKick(0, f"m{i}", "x:1"))
            await trio.sleep(0.001)
        with trio.move_on_after(2 * STALL_TIMEOUT + 15):
            # Until b applied everything and a heard so (acknowledgements freed its window).
            while len(got) < BEFORE + DURING or a.stats()["b"]["unacked"]:
                await trio.sleep(0.01)
        done_after = time.monotonic() - cut_at
        after_ports = await trio.to_thread.run_sync(_link_ports, servers[1])
        stats = a.stats()["b"]
        nursery.cancel_scope.cancel()
    return {"received": len(got), "in_order": got == [f"m{i}" for i in range(len(got))],
            "distinct": len(set(got)), "expected": BEFORE + DURING,
            "done_after_s": round(done_after, 2), "replaced": stats["replaced"],
            "replayed": stats["replayed"], "unacked": stats["unacked"],
            "old_port": ports[0], "new_ports": after_ports}


if __name__ == "__main__":
    print(json.dumps(trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "both")))
    sys.stdout.flush()
