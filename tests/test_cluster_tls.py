"""Cluster TLS (``mqttring.cluster_tls``): the RPC, the data links and the admin commands over
mutual TLS with the cluster's own CA, certificates made by ``mqttring cert``.

Real certificates, real sockets; the cluster test runs real ``mqttring.node`` processes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from cluster_support import Clients, Delivery, NodeCluster, unique
from mqttring.certs import CertError, make_ca, make_node_cert
from mqttring.cluster_tls import ClusterTls
from mqttring.config import BrokerConfig, ConfigError
from mqttring.rpc import AuthError, Peer, RpcServer, call_once, derive_key

pytestmark = pytest.mark.timeout(120)

KEY = derive_key("s3cret", "mqttring-rpc-v1")


def cert_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mqttring.cli", "cert", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, ClusterTls]:
    """Contexts for nodes "a" and "b" of the cluster CA, and "a" of a rogue CA."""
    cluster, rogue = tmp_path / "cluster", tmp_path / "rogue"
    make_ca(cluster)
    make_ca(rogue)
    made = {}
    for directory, name, label in ((cluster, "a", "a"), (cluster, "b", "b"),
                                   (rogue, "a", "rogue")):
        cert, key = make_node_cert(directory, name)
        made[label] = ClusterTls.from_files(directory / "ca.pem", cert, key)
    # Signed by the rogue CA but trusting the cluster's: it verifies the server, and is
    # refused by it.
    made["rogue-client"] = ClusterTls.from_files(cluster / "ca.pem", rogue / "a.pem",
                                                 rogue / "a.key")
    return made


async def test_rpc_needs_a_certificate_from_the_cluster_ca_and_the_secret(
        nursery: trio.Nursery, pki: dict[str, ClusterTls], caplog) -> None:
    server = RpcServer(KEY, "a", tls=pki["a"].server)

    async def echo(body: dict, peer: Peer) -> dict:
        return {"echo": body, "from": peer.node_id}

    server.register("echo", echo)
    port = await nursery.start(server.serve, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    reply = await call_once(address, KEY, "b", "echo", {"x": 1}, tls=pki["b"].client)
    assert reply == {"echo": {"x": 1}, "from": "b"}
    # A client certificate from another CA: refused by the server.
    with pytest.raises(AuthError, match="refuse our certificate"):
        await call_once(address, KEY, "b", "echo", tls=pki["rogue-client"].client)
    # A server certificate from a CA this client does not trust: refused by the client.
    with pytest.raises(AuthError, match="certificate verify failed"):
        await call_once(address, KEY, "b", "echo", tls=pki["rogue"].client)
    # The right certificate is not enough without the secret.
    with pytest.raises(AuthError):
        await call_once(address, derive_key("wrong", "mqttring-rpc-v1"), "b", "echo",
                        tls=pki["b"].client)
    # Plain TCP gets nothing from a TLS cluster port.
    with pytest.raises((EOFError, OSError, trio.BrokenResourceError, trio.TooSlowError)):
        await call_once(address, KEY, "b", "echo", timeout=3)
    with trio.fail_after(5):
        while server.refused < 4:
            await trio.sleep(0.02)
    assert server.refused == 4
    assert "refused cluster connection from 127.0.0.1:" in caplog.text
    # A TLS client and a node without cluster TLS do not talk either.
    plain_server = RpcServer(KEY, "p")
    plain_server.register("echo", echo)
    plain_port = await nursery.start(plain_server.serve, "127.0.0.1:0")
    with pytest.raises(AuthError, match="TLS with"):
        await call_once(f"127.0.0.1:{plain_port}", KEY, "b", "echo", tls=pki["b"].client,
                        timeout=5)


def test_cert_cli_and_config_checks(tmp_path: Path) -> None:
    """``mqttring cert`` makes a CA and node certificates, never overwrites one, and says
    what is missing; the node's cluster TLS settings go together."""
    pki = tmp_path / "pki"
    assert cert_cli("node", str(pki), "a").returncode == 2  # no CA yet
    made = cert_cli("ca", str(pki))
    assert made.returncode == 0, made.stderr
    made = cert_cli("node", str(pki), "a", "b")
    assert made.returncode == 0, made.stderr
    assert (pki / "a.key").stat().st_mode & 0o077 == 0, "a private key readable by others"
    again = cert_cli("node", str(pki), "a")
    assert again.returncode == 2 and "exists" in again.stderr
    with pytest.raises(CertError):
        make_node_cert(pki, "../escape")
    with pytest.raises(ConfigError, match="needs all of"):
        BrokerConfig(cluster_cafile=pki / "ca.pem")
    with pytest.raises(ConfigError, match="cannot load cluster_certfile"):
        ClusterTls.from_files(pki / "ca.pem", pki / "a.pem", pki / "b.key")


def test_a_cluster_over_mutual_tls(tmp_path: Path, clients: Clients) -> None:
    """Two nodes with certificates from ``mqttring cert`` form a cluster and carry a publish
    from one to a subscriber on the other; ``mqttring status`` works with an admin
    certificate, and not without one."""
    pki = tmp_path / "pki"
    assert cert_cli("ca", str(pki)).returncode == 0
    assert cert_cli("node", str(pki), "a", "b", "admin").returncode == 0
    root = tmp_path / "cluster"
    root.mkdir()
    cluster = NodeCluster(root)
    for node in ("a", "b"):
        cluster.node_toml[node] = (f'cluster_cafile = "{pki / "ca.pem"}"\n'
                                    f'cluster_certfile = "{pki / node}.pem"\n'
                                    f'cluster_keyfile = "{pki / node}.key"\n')
    admin = ClusterTls.from_files(pki / "ca.pem", pki / "admin.pem", pki / "admin.key")
    cluster.tls = admin.client
    try:
        cluster.form_sync("a", "b")
        view = cluster.settle(("a", "b"))
        assert view.up() == {"a", "b"}
        topic = cluster.view("a").topic_owned_by("a", unique("tls"))
        sub = clients.connected(cluster.port("b"))
        sub.subscribe(topic, 1)
        clients.connected(cluster.port("a")).publish(topic, b"through tls", 1)
        assert sub.collect(1) == [Delivery(topic, b"through tls", 1, False)]
        status = [sys.executable, "-m", "mqttring.cli", "status", "--node",
                  cluster.procs["a"].cluster, "--secret", cluster.secret]
        tls_flags = ["--cluster-cafile", str(pki / "ca.pem"), "--cluster-certfile",
                     str(pki / "admin.pem"), "--cluster-keyfile", str(pki / "admin.key")]
        done = subprocess.run(status + tls_flags, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "a" in done.stdout and "b" in done.stdout
        plain = subprocess.run([*status, "--timeout", "3"], capture_output=True, text=True,
                               timeout=60)
        assert plain.returncode == 1
        assert cluster.status_sync("a")["rpc_refused"] >= 1
    finally:
        cluster.close()


async def test_single_node_admin_over_mutual_tls(tmp_path: Path) -> None:
    """A single node's ``admin`` address speaks cluster TLS too, when it is configured."""
    from mqttring import MqttRingBroker

    pki = tmp_path / "pki"
    make_ca(pki)
    node_cert, node_key = make_node_cert(pki, "node")
    admin_cert, admin_key = make_node_cert(pki, "admin")
    config = BrokerConfig(mqtt="127.0.0.1:0", admin="127.0.0.1:0", cluster_secret="s3cret",
                          data_dir=tmp_path / "data", sys_interval=0,
                          cluster_cafile=pki / "ca.pem", cluster_certfile=node_cert,
                          cluster_keyfile=node_key)
    admin = ClusterTls.from_files(pki / "ca.pem", admin_cert, admin_key)
    async with MqttRingBroker(config) as broker:
        address = f"127.0.0.1:{broker.admin_port}"
        stats = await call_once(address, KEY, "ops", "stats", tls=admin.client)
        assert stats["node_id"] == config.node_id
        with pytest.raises((EOFError, OSError, trio.BrokenResourceError, trio.TooSlowError)):
            await call_once(address, KEY, "ops", "stats", timeout=2)
        assert broker.admin is not None
        with trio.fail_after(10):
            while broker.admin.refused < 1:  # once the node sees our plain client hang up
                await trio.sleep(0.02)


def tls_toml(directory: Path, name: str, cafile: Path | None = None) -> str:
    return (f'cluster_cafile = "{cafile or directory / "ca.pem"}"\n'
            f'cluster_certfile = "{directory / name}.pem"\n'
            f'cluster_keyfile = "{directory / name}.key"\n')


@pytest.mark.parametrize("trusts", ["cluster-ca", "own-ca"])
def test_a_node_with_a_certificate_from_another_ca_cannot_join(tmp_path: Path,
                                                               trusts: str) -> None:
    """A real node whose certificate ``mqttring cert`` made with another CA tries to join a
    TLS cluster (with the right secret): the member refuses it in the TLS handshake and
    logs the refusal, the node never becomes a member.  ``cluster-ca``: it trusts the
    cluster's CA (so only its own certificate is wrong, and the member's verification is
    what stops it); ``own-ca``: it trusts only its own CA and refuses the member too."""
    pki, rogue = tmp_path / "pki", tmp_path / "rogue"
    for directory, names in ((pki, ("a", "b", "admin")), (rogue, ("x",))):
        assert cert_cli("ca", str(directory)).returncode == 0
        made = cert_cli("node", str(directory), *names)
        assert made.returncode == 0, made.stderr
    root = tmp_path / "cluster"
    root.mkdir()
    cluster = NodeCluster(root)
    cluster.node_toml = {"a": tls_toml(pki, "a"), "b": tls_toml(pki, "b"),
                         "x": tls_toml(rogue, "x", pki / "ca.pem" if trusts == "cluster-ca"
                                       else None)}
    cluster.tls = ClusterTls.from_files(pki / "ca.pem", pki / "admin.pem",
                                        pki / "admin.key").client
    try:
        cluster.form_sync("a", "b")
        cluster.settle(("a", "b"))
        refused_before = cluster.status_sync("a")["rpc_refused"]
        cluster.start("x", join=cluster.procs["a"].cluster)
        deadline = time.monotonic() + 20
        refusals: list[str] = []
        while not refusals:
            assert time.monotonic() < deadline, (
                f"a logged no refusal in 20 s:\n{cluster.tail('a')}\n--- x:\n"
                f"{cluster.tail('x')}")
            refusals = cluster.grep("a", "refused cluster connection from 127.0.0.1:")
            time.sleep(0.1)
        if trusts == "cluster-ca":  # a's own verification refused x's certificate
            assert any("certificate verify failed" in line for line in refusals), refusals
        assert cluster.status_sync("a")["rpc_refused"] > refused_before
        # x gives up at once with one line that says why, not a traceback: a certificate
        # from the wrong CA does not get better by retrying.
        x = cluster.procs["x"].popen
        assert x is not None
        assert x.wait(30) == 1, cluster.tail("x")
        assert not cluster.procs["x"].ready_file.exists(), "x said it was ready"
        told = cluster.grep("x", "mqttring: cannot start node:")
        expected = {"cluster-ca": "refuse our certificate",
                    "own-ca": "certificate verify failed"}[trusts]
        assert told and expected in told[-1], cluster.tail("x")
        assert not cluster.grep("x", "Traceback"), cluster.tail("x")
        for node in ("a", "b"):
            assert "x" not in cluster.view(node).members
        assert cluster.settle(("a", "b")).up() == {"a", "b"}
    finally:
        cluster.close()
