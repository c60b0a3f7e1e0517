"""Network namespaces for the fault suite: a private bridge, one namespace per node and one
for the clients, and nftables rules inside node namespaces to cut or thin links.

Why namespaces rather than loopback: a partition needs traffic *between two node processes*
to be dropped while a client can still reach both, which loopback (one interface, one
address family of rules shared by everything on the host) cannot express cleanly.  With one
namespace per node, a rule installed inside ``n3``'s namespace touches only ``n3``'s packets.

Safety rules kept here:

* Every address lives in a private /24 (``10.231.<run % 200>.0/24``) that exists only inside
  the namespaces this module creates; nothing is routed to or from the host's namespace.
* Names are ``mqf<pid>...`` so concurrent runs never collide, and ``remove_stale`` deletes
  namespaces of earlier runs whose process is gone (a crashed run cannot leak forever).
* ``Topology.teardown`` is idempotent; callers register it with ``atexit`` and signal
  handlers as well as ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

PREFIX = "mqf"
IP = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else "ip"
NFT = "/usr/sbin/nft" if os.path.exists("/usr/sbin/nft") else "nft"
TABLE = "mqf"
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z]")


def _run(*cmd: str, stdin: str | None = None, check: bool = True
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, check=check,
                          timeout=20)


def list_namespaces() -> list[str]:
    out = _run(IP, "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL what still runs inside ``ns`` (only processes this suite started live there:
    the namespace is ours and nothing else is ever launched into it)."""
    out = _run(IP, "netns", "pids", ns, check=False).stdout
    for token in out.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            pid = int(token)
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)


def delete_namespace(ns: str) -> None:
    kill_namespace_processes(ns)
    _run(IP, "netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Delete ``mqf<pid>*`` namespaces left by runs whose process no longer exists."""
    removed = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            delete_namespace(ns)
            removed.append(ns)
    return removed


def can_create_namespaces() -> tuple[bool, str]:
    """Try a throwaway namespace: the only reliable test (root alone is not enough in some
    containers)."""
    if os.geteuid() != 0:
        return False, "the fault suite needs root (network namespaces, nftables)"
    name = f"{PREFIX}{os.getpid()}probe"
    try:
        res = _run(IP, "netns", "add", name, check=False)
        if res.returncode != 0:
            return False, f"cannot create a network namespace: {res.stderr.strip()}"
        res = _run(IP, "netns", "exec", name, NFT, "list", "tables", check=False)
        if res.returncode != 0:
            return False, f"nft does not work inside a namespace: {res.stderr.strip()}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create a network namespace: {exc}"
    finally:
        _run(IP, "netns", "del", name, check=False)


@dataclass
class Topology:
    """Hub namespace with bridge ``br0``; member namespaces each with ``eth0`` on it."""

    nodes: list[str]
    run_id: int = field(default_factory=os.getpid)
    hub: str = ""
    client: str = ""
    namespaces: dict[str, str] = field(default_factory=dict)  # node -> namespace
    addresses: dict[str, str] = field(default_factory=dict)  # node or "client" -> address
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        base = f"{PREFIX}{self.run_id}"
        self.hub = f"{base}h"
        self.client = f"{base}c"
        subnet = f"10.231.{self.run_id % 200}"
        for i, node in enumerate(self.nodes):
            self.namespaces[node] = f"{base}{node}"
            self.addresses[node] = f"{subnet}.{11 + i}"
        self.addresses["client"] = f"{subnet}.100"

    def to_dict(self) -> dict[str, object]:
        return {"nodes": self.nodes, "run_id": self.run_id, "hub": self.hub,
                "client": self.client, "namespaces": self.namespaces,
                "addresses": self.addresses}

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> Topology:
        topo = cls(list(raw["nodes"]), int(raw["run_id"]))  # type: ignore[arg-type,call-overload]
        return topo

    def setup(self) -> None:
        _run(IP, "netns", "add", self.hub)
        self.created.append(self.hub)
        _run(IP, "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run(IP, "-n", self.hub, "link", "set", "br0", "up")
        _run(IP, "-n", self.hub, "link", "set", "lo", "up")
        members = [*((self.namespaces[n], self.addresses[n]) for n in self.nodes),
                   (self.client, self.addresses["client"])]
        for index, (ns, addr) in enumerate(members):
            _run(IP, "netns", "add", ns)
            self.created.append(ns)
            port = f"v{index}"
            _run(IP, "-n", self.hub, "link", "add", port, "type", "veth",
                 "peer", "name", "eth0", "netns", ns)
            _run(IP, "-n", self.hub, "link", "set", port, "master", "br0")
            _run(IP, "-n", self.hub, "link", "set", port, "up")
            _run(IP, "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run(IP, "-n", ns, "link", "set", "eth0", "up")
            _run(IP, "-n", ns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Delete every namespace of this run (members first, the hub last); idempotent."""
        names = [self.client, *self.namespaces.values(), self.hub]
        existing = set(list_namespaces())
        for ns in names:
            if ns in existing:
                delete_namespace(ns)
        self.created.clear()

    # ------------------------------------------------------------------ faults (nftables)

    def _apply(self, node: str, chains: str) -> None:
        ns = self.namespaces[node]
        self._heal_one(node)
        script = (f"table inet {TABLE} {{\n"
                  f"  chain input {{ type filter hook input priority 0; policy accept;\n{chains}"
                  f"  }}\n}}\n")
        _run(IP, "netns", "exec", ns, NFT, "-f", "-", stdin=script)

    def _set(self, nodes: Iterable[str]) -> str:
        return "{ " + ", ".join(self.addresses[n] for n in nodes) + " }"

    def cut(self, node: str, peers: Iterable[str]) -> None:
        """Drop every packet ``node`` receives from ``peers``.

        Only on input, and callers cut both ends: a sender then sees silence (timeouts), as
        in a real netsplit, rather than the immediate EPERM an output-chain drop returns."""
        peers = [p for p in peers if p != node]
        if peers:
            self._apply(node, f"    ip saddr {self._set(peers)} drop\n")

    def isolate(self, node: str) -> None:
        """Cut ``node`` from every other node; the client namespace still reaches it."""
        others = [n for n in self.nodes if n != node]
        self.cut(node, others)
        for other in others:
            self.cut(other, [node])

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        side_a, side_b = list(side_a), list(side_b)
        for node in side_a:
            self.cut(node, side_b)
        for node in side_b:
            self.cut(node, side_a)

    def loss(self, percent: int) -> None:
        """Drop ``percent``% of packets between node addresses (on receipt, so each packet
        meets the rule once); client traffic is untouched."""
        for node in self.nodes:
            others = self._set(n for n in self.nodes if n != node)
            self._apply(node, f"    ip saddr {others} numgen random mod 100 < {percent} drop\n")

    def degrade(self, node: str, percent: int) -> None:
        """Drop ``percent``% of the packets between ``node`` and every other node, both ways
        (a failing NIC or cable: the node is slow to reach, not cut off)."""
        others = [n for n in self.nodes if n != node]
        rule = f"numgen random mod 100 < {percent} drop"
        self._apply(node, f"    ip saddr {self._set(others)} {rule}\n")
        for other in others:
            self._apply(other, f"    ip saddr {self.addresses[node]} {rule}\n")

    def _heal_one(self, node: str) -> None:
        _run(IP, "netns", "exec", self.namespaces[node], NFT, "delete", "table", "inet", TABLE,
             check=False)

    def heal(self) -> None:
        for node in self.nodes:
            self._heal_one(node)

    def rules(self) -> dict[str, str]:
        """Current rule sets, for the report when a fault misbehaves."""
        return {n: _run(IP, "netns", "exec", ns, NFT, "list", "ruleset", check=False).stdout
                for n, ns in self.namespaces.items()}
