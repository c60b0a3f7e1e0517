"""``make cluster`` / ``python -m mqttring.devcluster``: a local N-node cluster on loopback.

For trying things out: starts N full nodes (the first forms the cluster, the others join
through it), prints each node's addresses, its log file and commands that work from here
(``python -m mqttring status ...``, with this interpreter), and stops them all on Ctrl-C.

Repeatable by design: every run uses the same fixed ports (node *i*, from 0: MQTT
``base + 10i``, cluster ``base + 10i + 1``, Raft ``base + 10i + 2``; ``--base-port``,
default 17000) and starts from **fresh state**: what an earlier run left under ``--data-dir``
(``node<i>`` directories, logs) is removed first, since a Raft journal remembering other
ports or other members would only get in the way.  The nodes run in their own session, so
Ctrl-C reaches this process alone, which stops them together (SIGTERM, without leaving: the
whole cluster goes), kills any that do not stop within ``STOP_SECONDS`` and exits 0.  A node
that cannot start (a port still in use, say) is reported in one line (exit 1) and the
others are stopped.  SIGINT, SIGTERM and SIGHUP (its terminal closed) all stop it so, at any
moment: they are held from the process's first line (``mqttring.stop_signals``), so one
that comes while it imports, makes its certificates or starts the nodes stops the nodes
started so far and exits 0 (before, SIGTERM or SIGHUP then killed this process and left
the nodes, in their own session, running).

The cluster ports use mutual TLS with a CA made for the run (``mqttring.certs``, in
``<data-dir>/pki``; ``--plain`` turns it off), as a cluster across a real network should:
the printed commands carry the admin certificate they need.
"""

from __future__ import annotations

from mqttring.stop_signals import HELD, HeldSignals, hold

#: Run as ``python -m mqttring.devcluster``: stop signals are held from here, before the
#: imports below.  Imported as a module: nothing (``main`` holds them when it runs).
_HELD_AT_START: HeldSignals | None = hold() if __name__ == "__main__" else None

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from mqttring.certs import make_ca, make_node_cert

#: Seconds each node gets to become ready.
READY_SECONDS = 60.0
#: Seconds the nodes get to stop on Ctrl-C before they are killed.
STOP_SECONDS = 20.0
#: What an earlier run left in the data directory (and nothing else is removed).
_OURS = re.compile(r"node\d+(\.log|\.ready|\.ready\.tmp|\.toml)?|pki")


class DevClusterError(Exception):
    """A node could not start; the message says which and why (its last log line)."""


@dataclass
class DevNode:
    name: str
    mqtt: str
    cluster: str
    raft: str
    data_dir: Path
    log_file: Path
    ready_file: Path
    process: trio.Process | None = None


def plan(nodes: int, data_dir: Path, base_port: int) -> list[DevNode]:
    return [DevNode(f"node{i + 1}", f"127.0.0.1:{base_port + 10 * i}",
                    f"127.0.0.1:{base_port + 10 * i + 1}", f"127.0.0.1:{base_port + 10 * i + 2}",
                    data_dir / f"node{i + 1}", data_dir / f"node{i + 1}.log",
                    data_dir / f"node{i + 1}.ready")
            for i in range(nodes)]


def clear_state(data_dir: Path) -> None:
    """Remove what an earlier run left (only names this module creates)."""
    if not data_dir.exists():
        return
    for entry in data_dir.iterdir():
        if _OURS.fullmatch(entry.name):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _python() -> str:
    """This interpreter, relative to the working directory when under it (``.venv/...``)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def make_pki(directory: Path, nodes: list[DevNode]) -> dict[str, list[str]]:
    """A CA for this run and a certificate per node and one for the admin commands; returns
    the ``--cluster-*`` flags of each (by node name, and ``"admin"``)."""
    ca = make_ca(directory, name="mqttring dev cluster CA")
    flags: dict[str, list[str]] = {}
    for name in [n.name for n in nodes] + ["admin"]:
        cert, key = make_node_cert(directory, name)
        flags[name] = ["--cluster-cafile", str(ca), "--cluster-certfile", str(cert),
                       "--cluster-keyfile", str(key)]
    return flags


async def _start(node: DevNode, join: str | None, secret: str, tls: list[str]) -> None:
    node.data_dir.mkdir(parents=True, exist_ok=True)
    config = node.data_dir.parent / f"{node.name}.toml"
    config.write_text("heartbeat_interval = 0.5\nfailure_grace = 3.0\n")
    cmd = [sys.executable, "-m", "mqttring.node", "--node-id", node.name, "--mqtt", node.mqtt,
           "--cluster", node.cluster, "--raft", node.raft, "--data-dir", str(node.data_dir),
           "--config", str(config), "--ready-file", str(node.ready_file), "--stay-on-stop",
           "--log-file", str(node.log_file), *tls]
    if join is not None:
        cmd += ["--join", join]
    with node.log_file.open("ab") as log:  # what a node prints outside its log, too
        node.process = await trio.lowlevel.open_process(
            cmd, env={**os.environ, "MQTTRING_CLUSTER_SECRET": secret}, start_new_session=True,
            stdout=log, stderr=subprocess.STDOUT)


async def _wait_ready(node: DevNode) -> None:
    with trio.move_on_after(READY_SECONDS):
        while True:
            assert node.process is not None
            if node.process.returncode is not None:
                raise DevClusterError(f"{node.name} exited with {node.process.returncode}: "
                                      f"{_last_line(node.log_file)}")
            try:
                json.loads(node.ready_file.read_text())
                return
            except (FileNotFoundError, json.JSONDecodeError):
                await trio.sleep(0.1)
    raise DevClusterError(f"{node.name} not ready in {READY_SECONDS:.0f} s: "
                          f"{_last_line(node.log_file)}")


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


async def stop_all(nodes: list[DevNode]) -> None:
    running = [n.process for n in nodes if n.process and n.process.returncode is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(STOP_SECONDS):
        for process in running:
            await process.wait()
    for process in running:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _bring_up(nodes: list[DevNode], secret: str, tls: dict[str, list[str]]) -> None:
    """Start the nodes one after the other (the first forms the cluster) and print how to
    reach them."""
    for node in nodes:
        await _start(node, None if node is nodes[0] else nodes[0].cluster, secret,
                     tls.get(node.name, []))
        await _wait_ready(node)
    py = _python()
    admin = " ".join(tls.get("admin", []))
    admin = f" {admin}" if admin else ""
    how = "mutual TLS on the cluster ports" if tls else "plain TCP cluster ports"
    print(f"{len(nodes)}-node cluster up (secret {secret!r}, {how}); Ctrl-C stops it")
    for node in nodes:
        print(f"  {node.name}: mqtt {node.mqtt}  cluster {node.cluster}  log {node.log_file}")
    print(f"status: MQTTRING_CLUSTER_SECRET={secret} {py} -m mqttring status "
          f"--node {nodes[0].cluster}{admin}")
    print(f"leave:  MQTTRING_CLUSTER_SECRET={secret} {py} -m mqttring leave "
          f"--node {nodes[-1].cluster}{admin}", flush=True)


async def run(nodes: list[DevNode], secret: str, tls: dict[str, list[str]],
              held: HeldSignals | None = None) -> None:
    """Bring the cluster up and keep it until a stop signal; stop every node started.

    The signal receiver is open before the first node starts, and what ``held`` recorded
    before trio ran is taken right after it, so a signal at any moment of the start stops
    the nodes started so far.  Raises ``DevClusterError`` when a node could not start.
    """
    failed: list[DevClusterError] = []
    try:
        with trio.open_signal_receiver(*HELD) as signals:
            async with trio.open_nursery() as nursery:

                async def bring_up() -> None:
                    try:
                        await _bring_up(nodes, secret, tls)
                    except DevClusterError as exc:
                        failed.append(exc)
                        nursery.cancel_scope.cancel()

                # After the receiver is open, so that no signal falls between the two.
                if not (held is not None and held.take()):
                    nursery.start_soon(bring_up)
                    async for _ in signals:
                        break
                print("stopping the cluster", flush=True)
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await stop_all(nodes)
    if failed:
        raise failed[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqttring.devcluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("data/cluster"))
    parser.add_argument("--base-port", type=int, default=17000)
    parser.add_argument("--secret", default="dev-cluster-secret")
    parser.add_argument("--plain", action="store_true",
                        help="cluster ports without TLS (default: mutual TLS, a CA per run)")
    held = hold()  # already, when run as a command (idempotent)
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 9 or not 1024 <= args.base_port <= 65535 - 10 * args.nodes:
        parser.error("need 1 <= --nodes <= 9 and a --base-port leaving room for 10 per node")
    data_dir = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    clear_state(data_dir)
    nodes = plan(args.nodes, data_dir, args.base_port)
    tls = {} if args.plain else make_pki(data_dir / "pki", nodes)
    try:
        trio.run(run, nodes, args.secret, tls, held)
    except DevClusterError as exc:
        print(f"mqttring.devcluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
