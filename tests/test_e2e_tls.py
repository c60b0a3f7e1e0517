"""TLS listeners (``mqtts``, ``wss``) with real certificates, real clients and real sockets.

Certificates are issued in the test by ``trustme`` (real X.509, real keys): a server CA, a
client CA, and a second CA nobody trusts.  Clients are mosquitto_pub/mosquitto_sub, paho
(TCP and WebSocket) and the standard ``ssl`` module where the test needs to see the exact
verification error.
"""

from __future__ import annotations

import datetime
import json
import logging
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

from conftest import HOST, WAIT, BrokerHandle

pytestmark = pytest.mark.timeout(90)


@dataclass
class Pki:
    """Files of one test's certificates."""

    ca: Path  #: the server CA clients trust
    cert: Path  #: server certificate for 127.0.0.1 / localhost, signed by ``ca``
    key: Path
    client_ca: Path  #: the CA that signs client certificates
    alice_cert: Path  #: client certificate, CN "alice", signed by ``client_ca``
    alice_key: Path
    rogue_ca: Path  #: a CA nobody trusts
    rogue_cert: Path  #: client certificate CN "alice" signed by ``rogue_ca``
    rogue_key: Path
    root: Path
    cas: dict[str, trustme.CA]

    def server_cert(self, name: str, ca: str = "server", hosts: tuple[str, ...] = (
            "127.0.0.1", "localhost"), **kwargs: Any) -> tuple[Path, Path]:
        """Issue another server certificate; returns (cert, key) paths."""
        leaf = self.cas[ca].issue_cert(*hosts, **kwargs)
        cert, key = self.root / f"{name}.pem", self.root / f"{name}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        return cert, key


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    root = tmp_path / "pki"
    root.mkdir()
    cas = {"server": trustme.CA(), "client": trustme.CA(), "rogue": trustme.CA()}
    for name, ca in cas.items():
        ca.cert_pem.write_to_path(str(root / f"{name}-ca.pem"))
    paths: dict[str, Path] = {}
    for name, ca in (("alice", "client"), ("rogue", "rogue")):
        leaf = cas[ca].issue_cert("alice.example", common_name="alice")
        paths[f"{name}_cert"] = root / f"{name}.pem"
        paths[f"{name}_key"] = root / f"{name}.key"
        leaf.cert_chain_pems[0].write_to_path(str(paths[f"{name}_cert"]))
        leaf.private_key_pem.write_to_path(str(paths[f"{name}_key"]))
    pki = Pki(root / "server-ca.pem", root / "server.pem", root / "server.key",
              root / "client-ca.pem", rogue_ca=root / "rogue-ca.pem", root=root, cas=cas,
              **paths)
    pki.server_cert("server")
    return pki


@dataclass
class TlsBroker:
    broker: Any  #: the in-process ``MqttRingBroker``
    mqtts: int
    wss: int
    plain: BrokerHandle  #: its plain TCP listener
    tls: BrokerHandle  #: mqtts as ``port``, wss as ``ws_port`` (for the paho fixture)


@pytest.fixture
def tls_broker(tmp_path: Path, pki: Pki) -> Iterator[Callable[..., TlsBroker]]:
    """``start(cert=None, key=None, limits=None, **settings) -> TlsBroker``: an in-process
    node with mqtt, mqtts and wss listeners on free ports; stopped at teardown."""
    from mqttring import BrokerConfig, Limits, MqttRingBroker

    running: list[Any] = []

    def start(cert: Path | None = None, key: Path | None = None,
              limits: dict[str, Any] | None = None, sys_interval: float = 0,
              **settings: Any) -> TlsBroker:
        data_dir = tmp_path / f"tls-broker{len(running)}"
        data_dir.mkdir()
        config = BrokerConfig(
            node_id=f"tls-{uuid.uuid4().hex[:6]}", mqtt=f"{HOST}:0", mqtts=f"{HOST}:0",
            wss=f"{HOST}:0", data_dir=data_dir, sys_interval=sys_interval,
            certfile=cert or pki.cert, keyfile=key or pki.key, limits=Limits(**(limits or {})),
            **settings,
        )
        broker = MqttRingBroker(config)
        ports = broker.start()
        running.append(broker)
        assert ports.mqtts and ports.wss, ports
        return TlsBroker(broker, ports.mqtts, ports.wss,
                         BrokerHandle(HOST, ports.mqtt, None, data_dir),
                         BrokerHandle(HOST, ports.mqtts, ports.wss, data_dir))

    yield start
    for broker in reversed(running):
        broker.stop()


def tls_paho(paho: Callable[..., Any], target: BrokerHandle, ca: Path, transport: str = "tcp",
             cert: Path | None = None, key: Path | None = None) -> Any:
    client = paho(transport=transport, target=target)
    client.client.tls_set(ca_certs=str(ca), certfile=cert and str(cert),
                          keyfile=key and str(key))
    return client


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None
                   ) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def tls_connect(port: int, context: ssl.SSLContext, server_hostname: str = HOST
                ) -> ssl.SSLSocket:
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    try:
        return context.wrap_socket(sock, server_hostname=server_hostname)
    except BaseException:
        sock.close()
        raise


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def read_to_close(sock: socket.socket, timeout: float) -> bytes:
    """What the peer sends until it closes; fails (socket timeout) if it does not close."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass  # closed with our bytes unread: a close all the same
    return got


def mosquitto(tool: str, port: int, topic: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [tool, "-h", HOST, "-p", str(port), "-t", topic, *extra]
    if tool == "mosquitto_sub":
        cmd += ["-C", "1", "-W", "15"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


CONNECT = bytes.fromhex("100f00044d5154540402001e0003616263")  # CONNECT, client id "abc"


# ------------------------------------------------------------------------------ tests


def test_mosquitto_over_mqtts_on_a_node_process(tmp_path: Path, pki: Pki, uid) -> None:
    """``python -m mqttring.node --mqtts ... --certfile ... --keyfile ...`` reports its mqtts
    port in the ready file; mosquitto_pub/mosquitto_sub with ``--cafile`` talk over it, and a
    mosquitto client that trusts another CA refuses the node's certificate.  SIGHUP reloads
    renewed certificate files for the next clients."""
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "mqttring.node", "--node-id", "tls1", "--mqtt", f"{HOST}:0",
           "--mqtts", f"{HOST}:0", "--certfile", str(pki.cert), "--keyfile", str(pki.key),
           "--data-dir", str(tmp_path / "data"), "--ready-file", str(ready)]
    with open(tmp_path / "node.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "ready file")
        assert proc.poll() is None, (tmp_path / "node.log").read_text()
        info = json.loads(ready.read_text())
        assert info["mqtts"] and info["wss"] is None
        port, topic = info["mqtts"], uid("mqtts")
        sent = mosquitto("mosquitto_pub", port, topic, "--cafile", str(pki.ca), "-q", "1",
                         "-r", "-m", "over tls")
        assert sent.returncode == 0, sent.stderr
        got = mosquitto("mosquitto_sub", port, topic, "--cafile", str(pki.ca))
        assert (got.returncode, got.stdout) == (0, "over tls\n"), got.stderr
        refused = mosquitto("mosquitto_pub", port, topic, "--cafile", str(pki.rogue_ca),
                            "-m", "x")
        assert refused.returncode != 0
        assert "TLS error" in refused.stderr, refused.stderr
        # Renewal: new files under the same names, then SIGHUP (no --config needed): the
        # next clients get the new certificate, here from another CA to tell them apart.
        renewed = pki.cas["rogue"].issue_cert(HOST)
        renewed.cert_chain_pems[0].write_to_path(str(pki.cert))
        renewed.private_key_pem.write_to_path(str(pki.key))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "TLS certificate" in (tmp_path / "node.log").read_text()
                 and "reloaded" in (tmp_path / "node.log").read_text(), 15, "reload line")
        sent = mosquitto("mosquitto_pub", port, topic, "--cafile", str(pki.rogue_ca), "-m", "y")
        assert sent.returncode == 0, sent.stderr
        old_ca = mosquitto("mosquitto_pub", port, topic, "--cafile", str(pki.ca), "-m", "z")
        assert old_ca.returncode != 0
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0


def write_crl(pki: Pki, path: Path, revoked: tuple[Path, ...],
              valid_for: datetime.timedelta = datetime.timedelta(days=1)) -> None:
    """A CRL of the client CA listing ``revoked`` certificates (by serial), signed with the
    CA's key, as ``openssl ca -gencrl`` would write it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca = pki.cas["client"]
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - datetime.timedelta(hours=1)).next_update(now + valid_for))
    for cert in revoked:
        serial = x509.load_pem_x509_certificate(cert.read_bytes()).serial_number
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial)
            .revocation_date(now - datetime.timedelta(hours=1)).build())
    crl = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))


def test_a_revoked_client_certificate_is_refused_until_the_list_changes(
        tmp_path: Path, pki: Pki, uid) -> None:
    """``--crlfile`` on a node process: a client certificate the CRL lists fails the
    handshake, another from the same CA is let in; SIGHUP reads the list again (bob
    reinstated, alice revoked); a CRL past its next update lets nobody in (OpenSSL's rule,
    documented); and a file that is no CRL stops the node at start-up with one line."""
    bob_cert, bob_key = pki.server_cert("bob", ca="client", hosts=("bob.example",),
                                        common_name="bob")
    crl = pki.root / "client-ca.crl"
    write_crl(pki, crl, revoked=(bob_cert,))
    cmd, ready, log = crl_node_command(pki, tmp_path, crl, "crl1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        publish = crl_node_publisher(pki, proc, ready, log, uid("crl"))
        assert publish(pki.alice_cert, pki.alice_key).returncode == 0
        refused = publish(bob_cert, bob_key)
        assert refused.returncode != 0
        wait_for(lambda: "certificate revoked" in log.read_text(), 10, "revocation logged")
        write_crl(pki, crl, revoked=(pki.alice_cert,))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in log.read_text(), 15, "reload line")
        assert publish(bob_cert, bob_key).returncode == 0
        assert publish(pki.alice_cert, pki.alice_key).returncode != 0
        write_crl(pki, crl, revoked=(), valid_for=-datetime.timedelta(minutes=1))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: log.read_text().count("reloaded") >= 2, 15, "second reload")
        assert publish(bob_cert, bob_key).returncode != 0
        wait_for(lambda: "CRL has expired" in log.read_text(), 10, "expired CRL logged")
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0
    crl.write_text("not a CRL\n")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(
        "mqttring: configuration error: cannot load crlfile"), done.stderr


def test_a_certificate_in_crlfile_is_refused_never_trusted(tmp_path: Path, pki: Pki,
                                                          uid) -> None:
    """OpenSSL loads certificates from a CRL file too, which would make a CA certificate
    put there (by mistake or by someone who may write the list but not cafile) a trusted
    signer of client certificates.  A crlfile with anything but PEM CRLs stops the node
    at start-up with one line (exit 2); on SIGHUP the previous list stays in force and the
    rogue CA's client is still refused."""
    crl = pki.root / "client-ca.crl"
    write_crl(pki, crl, revoked=())
    good_crl = crl.read_bytes()
    rogue_ca = pki.rogue_ca.read_bytes()
    cmd, ready, log = crl_node_command(pki, tmp_path, crl, "crl2")
    after = good_crl.count(b"\n") + 1  # the first line after the CRL
    for content, why in ((good_crl + rogue_ca, f"line {after}: a PEM CERTIFICATE block"),
                         (rogue_ca, "line 1: a PEM CERTIFICATE block"),
                         (b"", "no X509 CRL in it"),
                         (good_crl + b"garbage\n", f"line {after}: not a PEM block"),
                         (good_crl.replace(b"\nM", b"\n!", 1), "does not parse")):
        crl.write_bytes(content)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"mqttring: configuration error: cannot load crlfile {crl}: ")
        assert why in lines[0], lines[0]
        assert not ready.exists()
    crl.write_bytes(good_crl)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        publish = crl_node_publisher(pki, proc, ready, log, uid("crl"))
        assert publish(pki.alice_cert, pki.alice_key).returncode == 0
        assert publish(pki.rogue_cert, pki.rogue_key).returncode != 0
        crl.write_bytes(good_crl + rogue_ca)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "not reloaded" in log.read_text(), 15, "refused reload logged")
        assert "a PEM CERTIFICATE block, not an X509 CRL" in log.read_text()
        assert publish(pki.rogue_cert, pki.rogue_key).returncode != 0
        assert publish(pki.alice_cert, pki.alice_key).returncode == 0
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0
    assert "Traceback" not in log.read_text()


def crl_node_command(pki: Pki, tmp_path: Path, crl: Path, node_id: str
                     ) -> tuple[list[str], Path, Path]:
    """A node requiring client certificates of ``pki.client_ca``, revoked by ``crl``: its
    command line, ready file and log file."""
    ready, log = tmp_path / "ready.json", tmp_path / "node.log"
    return [sys.executable, "-m", "mqttring.node", "--node-id", node_id, "--mqtt", f"{HOST}:0",
            "--mqtts", f"{HOST}:0", "--certfile", str(pki.cert), "--keyfile", str(pki.key),
            "--cafile", str(pki.client_ca), "--require-certificate", "--crlfile", str(crl),
            "--data-dir", str(tmp_path / "data"), "--ready-file", str(ready)], ready, log


def crl_node_publisher(pki: Pki, proc: subprocess.Popen[bytes], ready: Path, log: Path,
                       topic: str) -> Callable[[Path, Path], subprocess.CompletedProcess[str]]:
    """Once the node is ready: a QoS 1 ``mosquitto_pub`` to it with a client certificate."""
    wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "ready file")
    assert proc.poll() is None, log.read_text()
    port = json.loads(ready.read_text())["mqtts"]

    def publish(cert: Path, key: Path) -> subprocess.CompletedProcess[str]:
        return mosquitto("mosquitto_pub", port, topic, "--cafile", str(pki.ca), "--cert",
                         str(cert), "--key", str(key), "-q", "1", "-m", "x")

    return publish


def test_a_crl_that_does_not_verify_with_its_ca_is_refused(pki: Pki, tmp_path: Path,
                                                          caplog) -> None:
    """A CRL naming a CA of cafile as its issuer but signed by another key would refuse
    every client of that CA at the handshake: refused at load instead.  One issued by a CA
    that is not in cafile (another cluster's list) loads, with a warning."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    from mqttring import BrokerConfig, ConfigError
    from mqttring.broker.tls import build_server_context

    crl = tmp_path / "forged.crl"
    client_ca = x509.load_pem_x509_certificate(pki.cas["client"].cert_pem.bytes())
    rogue_key = serialization.load_pem_private_key(
        pki.cas["rogue"].private_key_pem.bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    forged = (x509.CertificateRevocationListBuilder().issuer_name(client_ca.subject)
              .last_update(now).next_update(now + datetime.timedelta(days=1))
              .sign(rogue_key, hashes.SHA256()))  # type: ignore[arg-type]
    crl.write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    config = BrokerConfig(mqtts=f"{HOST}:0", certfile=pki.cert, keyfile=pki.key,
                          cafile=pki.client_ca, require_certificate=True, crlfile=crl)
    with pytest.raises(ConfigError, match="signature does not verify"):
        build_server_context(config)
    other = pki.cas["rogue"]
    rogue_ca = x509.load_pem_x509_certificate(other.cert_pem.bytes())
    theirs = (x509.CertificateRevocationListBuilder().issuer_name(rogue_ca.subject)
              .last_update(now).next_update(now + datetime.timedelta(days=1))
              .sign(rogue_key, hashes.SHA256()))  # type: ignore[arg-type]
    crl.write_bytes(theirs.public_bytes(serialization.Encoding.PEM))
    with caplog.at_level(logging.WARNING, logger="mqttring.broker.tls"):
        build_server_context(config)
    assert "which is not a CA of cafile" in caplog.text


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
def test_a_refused_client_certificate_gets_the_tls_alert_that_says_why(
        tls_broker, pki: Pki, version: ssl.TLSVersion) -> None:
    """The handshake's alert reaches the client before the close (as from mosquitto), so a
    device can log why: a certificate from a CA the node does not trust, none at all.  TLS
    1.3 clients see it at their first read, 1.2 ones in the handshake.  Before 2026-11-25
    the node closed without it and clients saw a bare EOF."""
    node = tls_broker(cafile=pki.client_ca, require_certificate=True)
    cases = [((pki.rogue_cert, pki.rogue_key), "unknown ca"),
             ((None, None), "certificate required" if version is ssl.TLSVersion.TLSv1_3
              else "handshake failure")]
    for (cert, key), alert in cases:
        context = client_context(pki.ca, cert, key)
        context.maximum_version = version
        with pytest.raises(ssl.SSLError, match=alert.replace(" ", ".")):
            sock = tls_connect(node.mqtts, context)
            with sock:
                sock.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x0a\x00\x00")
                sock.recv(4)
    assert node.broker.metrics.tls_handshake_failures == 2


def test_certificate_identity_is_the_username(tls_broker, paho, pki: Pki, uid,
                                              caplog) -> None:
    """``require_certificate`` + ``use_identity_as_username`` with anonymous logins off: a
    mosquitto client with a certificate from the client CA logs in as its CN whatever
    username and password it sends (and a paho client over wss with no username at all);
    a certificate from another CA is refused in the handshake (counted), and so is a client
    with no certificate."""
    caplog.set_level(logging.INFO, logger="mqttring")
    node = tls_broker(cafile=pki.client_ca, require_certificate=True,
                      use_identity_as_username=True, allow_anonymous=False)
    topic = uid("identity")
    alice = ("--cafile", str(pki.ca), "--cert", str(pki.alice_cert), "--key", str(pki.alice_key))
    sent = mosquitto("mosquitto_pub", node.mqtts, topic, *alice, "-u", "mallory", "-P", "nope",
                     "-r", "-q", "1", "-m", "signed")
    assert sent.returncode == 0, sent.stderr
    got = mosquitto("mosquitto_sub", node.mqtts, topic, *alice)
    assert (got.returncode, got.stdout) == (0, "signed\n"), got.stderr
    assert "certificate CN 'alice' is its username" in caplog.text
    over_wss = tls_paho(paho, node.tls, pki.ca, transport="websockets", cert=pki.alice_cert,
                        key=pki.alice_key)
    over_wss.connect()  # CONNACK 0 without a username: the certificate logged it in
    assert caplog.text.count("certificate CN 'alice' is its username") == 3
    over_wss.disconnect()
    metrics = node.broker.metrics
    assert metrics.tls_handshake_failures == 0
    rogue = mosquitto("mosquitto_pub", node.mqtts, topic, "--cafile", str(pki.ca),
                      "--cert", str(pki.rogue_cert), "--key", str(pki.rogue_key), "-m", "x")
    assert rogue.returncode != 0
    wait_for(lambda: metrics.tls_handshake_failures == 1, what="rogue handshake counted")
    anonymous = mosquitto("mosquitto_pub", node.mqtts, topic, "--cafile", str(pki.ca), "-m", "x")
    assert anonymous.returncode != 0
    wait_for(lambda: metrics.tls_handshake_failures == 2, what="no-certificate handshake")
    assert "TLS handshake with 127.0.0.1:" in caplog.text
    nameless_cert, nameless_key = pki.server_cert("nameless", ca="client", hosts=("x.example",))
    nameless = mosquitto("mosquitto_pub", node.mqtts, topic, "--cafile", str(pki.ca), "--cert",
                         str(nameless_cert), "--key", str(nameless_key), "-m", "x")
    assert nameless.returncode != 0
    assert "not authori" in nameless.stderr, nameless.stderr  # CONNACK 5: no CN, no username
    assert metrics.tls_handshake_failures == 2
    assert metrics.messages_received == 1  # only alice's publish got through


def test_paho_over_mqtts_and_wss(tls_broker, paho, pki: Pki, uid) -> None:
    """paho with ``tls_set`` over mqtts and over wss exchanges QoS 0/1/2 messages with a
    plain TCP client, both ways."""
    node = tls_broker()
    topic = uid("paho-tls")
    mqtts = tls_paho(paho, node.tls, pki.ca)
    wss = tls_paho(paho, node.tls, pki.ca, transport="websockets")
    plain = paho(target=node.plain)
    for client in (mqtts, wss, plain):
        client.connect()
    mqtts.subscribe(f"{topic}/to-mqtts", 2)
    wss.subscribe(f"{topic}/to-wss", 2)
    plain.subscribe(f"{topic}/to-plain", 2)
    for q in (0, 1, 2):
        plain.publish(f"{topic}/to-mqtts", f"p{q}", qos=q)
        mqtts.publish(f"{topic}/to-wss", f"m{q}", qos=q)
        wss.publish(f"{topic}/to-plain", f"w{q}", qos=q)
    assert sorted(m.payload for m in mqtts.collect(3)) == [b"p0", b"p1", b"p2"]
    assert sorted(m.payload for m in wss.collect(3)) == [b"m0", b"m1", b"m2"]
    assert sorted(m.payload for m in plain.collect(3)) == [b"w0", b"w1", b"w2"]
    big = bytes(range(256)) * 600  # several TLS records
    plain.publish(f"{topic}/to-wss", big, qos=1)
    plain.publish(f"{topic}/to-mqtts", big, qos=1)
    assert wss.get().payload == big
    assert mqtts.get().payload == big
    assert node.broker.metrics.tls_handshake_failures == 0


@pytest.mark.parametrize("case", ["expired", "wrong-ca", "wrong-hostname"])
def test_clients_refuse_bad_server_certificates(tls_broker, pki: Pki, case: str) -> None:
    """The node serves the certificate it is given: an expired one, one from a CA the client
    does not trust, or one for another host name fails the client's verification (mqtts and
    wss alike, with the verification error that says why)."""
    if case == "expired":
        now = datetime.datetime.now(datetime.UTC)
        cert, key = pki.server_cert("expired", not_before=now - datetime.timedelta(days=30),
                                    not_after=now - datetime.timedelta(days=1))
        expected = "certificate has expired"
    elif case == "wrong-ca":
        cert, key = pki.server_cert("rogue-server", ca="rogue")
        expected = "unable to get local issuer certificate"
    else:
        cert, key = pki.server_cert("elsewhere", hosts=("elsewhere.example",))
        expected = "IP address mismatch"
    node = tls_broker(cert=cert, key=key)
    for port in (node.mqtts, node.wss):
        with pytest.raises(ssl.SSLCertVerificationError, match=expected):
            tls_connect(port, client_context(pki.ca))
    # The same client accepts the server once it presents a good certificate.
    good = tls_broker()
    tls_connect(good.mqtts, client_context(pki.ca)).close()


def test_plaintext_garbage_and_stalled_handshakes(tls_broker, paho, pki: Pki, caplog) -> None:
    """Plaintext MQTT and garbage on the TLS port are closed at once and counted; a client
    that stalls half-way through its handshake delays no other client's TLS connect and is
    closed (and counted) after ``connect_timeout``."""
    caplog.set_level(logging.INFO, logger="mqttring")
    node = tls_broker(limits={"connect_timeout": 4.0}, sys_interval=0.5)
    metrics = node.broker.metrics
    watcher = paho(target=node.plain)
    watcher.connect()
    watcher.subscribe("$SYS/broker/tls/handshake_failures", 0)
    stalled = socket.create_connection((HOST, node.mqtts), timeout=WAIT)
    stalled_ws = socket.create_connection((HOST, node.wss), timeout=WAIT)
    try:
        stalled.sendall(bytes.fromhex("1603010200"))  # a ClientHello record header, no body
        # Meanwhile others connect: plaintext MQTT is refused, a TLS client gets through.
        for garbage in (CONNECT, b"GET / HTTP/1.1\r\n\r\n"):
            with socket.create_connection((HOST, node.mqtts), timeout=WAIT) as plain:
                plain.sendall(garbage)
                read_to_close(plain, WAIT)  # an alert at most, then the close; no CONNACK
        wait_for(lambda: metrics.tls_handshake_failures == 2, what="plaintext counted")
        client = tls_paho(paho, node.tls, pki.ca)
        client.connect()
        client.disconnect()
        # Connected while both stalls are still pending (not yet timed out, not counted).
        assert metrics.tls_handshake_failures == 2, "a stalled handshake held a client up"
        # The stalled ones are closed by the node once connect_timeout passes.
        for sock in (stalled, stalled_ws):
            read_to_close(sock, 15)
        wait_for(lambda: metrics.tls_handshake_failures == 4, what="stalls counted")
    finally:
        stalled.close()
        stalled_ws.close()
    assert "not completed within 4s" in caplog.text
    deadline = time.monotonic() + 10
    seen = b""
    while seen != b"4":  # $SYS catches up within an interval or two
        assert time.monotonic() < deadline, f"$SYS says {seen!r} handshake failures, not 4"
        seen = watcher.get(timeout=5).payload
    assert "TLS handshake with 127.0.0.1:" in caplog.text


def test_reload_swaps_the_certificate_for_new_connections_only(tls_broker, paho, pki: Pki,
                                                              uid) -> None:
    """``tls.reload()`` reads the files again: new clients get the new certificate (from
    another CA here), connections made before it keep working, and a reload of broken
    files keeps the certificate in use."""
    from mqttring import ConfigError

    cert, key = pki.server_cert("renewable")
    node = tls_broker(cert=cert, key=key)
    topic = uid("reload")
    before = tls_paho(paho, node.tls, pki.ca)
    before.connect()
    before.subscribe(topic, 1)
    renewed = pki.cas["rogue"].issue_cert(HOST)  # "renewed" by another CA: easy to tell apart
    renewed.cert_chain_pems[0].write_to_path(str(cert))
    renewed.private_key_pem.write_to_path(str(key))
    assert node.broker.tls is not None
    node.broker.tls.reload()
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_connect(node.mqtts, client_context(pki.ca))
    after = tls_paho(paho, node.tls, pki.rogue_ca)
    after.connect()
    after.publish(topic, b"after reload", qos=1)
    before.publish(topic, b"from before", qos=1)
    assert sorted(m.payload for m in before.collect(2)) == [b"after reload", b"from before"]
    key.write_text("not a key\n")
    with pytest.raises(ConfigError, match="cannot load certfile"):
        node.broker.tls.reload()
    tls_connect(node.wss, client_context(pki.rogue_ca)).close()  # still the renewed one


def test_tls_settings_are_checked_before_the_node_starts(tmp_path: Path, pki: Pki) -> None:
    """Missing or broken TLS files stop ``python -m mqttring.node`` with one line and exit
    status 2, before it listens anywhere."""
    from mqttring import BrokerConfig, ConfigError

    with pytest.raises(ConfigError, match="needs certfile and keyfile"):
        BrokerConfig(mqtts=f"{HOST}:0")
    with pytest.raises(ConfigError, match=r"keyfile = .*: not a readable file"):
        BrokerConfig(wss=f"{HOST}:0", certfile=pki.cert, keyfile=tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="needs require_certificate"):
        BrokerConfig(use_identity_as_username=True)
    with pytest.raises(ConfigError, match="needs cafile"):
        BrokerConfig(require_certificate=True)
    with pytest.raises(ConfigError, match="crlfile needs require_certificate"):
        BrokerConfig(cafile=pki.client_ca, crlfile=pki.client_ca)
    with pytest.raises(ConfigError, match="tls_min_version"):
        BrokerConfig(tls_min_version="1.1")
    config_file = tmp_path / "tls.toml"
    config_file.write_text(f'mqtts = "{HOST}:0"\ncertfile = "{pki.cert}"\n'
                           f'keyfile = "{pki.alice_key}"\ntls_min_version = "1.3"\n')
    done = subprocess.run(
        [sys.executable, "-m", "mqttring.node", "--config", str(config_file),
         "--mqtt", f"{HOST}:0", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "mqttring: configuration error: cannot load certfile"), done.stderr
    assert not (tmp_path / "data").exists()
    workers = subprocess.run(
        [sys.executable, "-m", "mqttring.node", "--workers", "2", "--mqtts", f"{HOST}:0",
         "--certfile", str(pki.cert), "--keyfile", str(pki.key), "--data-dir",
         str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert workers.returncode == 2, workers.stderr
    assert "--workers needs a fixed mqtts port" in workers.stderr


async def test_reload_in_thread_from_trio(pki: Pki) -> None:
    """The trio way to reload (the file reads run in a worker thread): a connection made
    before it goes on, the next one is served with the new certificate.  A node with only
    an mqtts listener, embedded in this trio program."""
    import trio

    from mqttring import BrokerConfig, MqttRingBroker

    cert, key = pki.server_cert("async-renewable")
    config = BrokerConfig(mqtt=None, mqtts=f"{HOST}:0", data_dir=None, sys_interval=0,
                          certfile=cert, keyfile=key)
    async with MqttRingBroker(config) as broker:
        assert broker.ports is not None and broker.tls is not None
        port = broker.ports.mqtts
        with trio.fail_after(20):
            before = await trio.open_ssl_over_tcp_stream(
                HOST, port, ssl_context=client_context(pki.ca))
            await before.do_handshake()
            renewed = pki.cas["rogue"].issue_cert(HOST)
            renewed.cert_chain_pems[0].write_to_path(str(cert))
            renewed.private_key_pem.write_to_path(str(key))
            await broker.tls.reload_in_thread()
            assert broker.tls.reloads == 1
            after = await trio.open_ssl_over_tcp_stream(
                HOST, port, ssl_context=client_context(pki.rogue_ca))
            for stream in (before, after):
                await stream.send_all(CONNECT)
                assert await stream.receive_some(4) == b"\x20\x02\x00\x00"  # CONNACK 0
                await stream.aclose()
