"""Logins against a real node process with a password file (``docs/security.md``): made by the
real ``mosquitto_passwd``, refused and accepted as mosquitto would, and a password-guessing
client limited per source address without slowing anybody else's login."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time

import pytest

from mqtt_client import RawClient

pytestmark = pytest.mark.timeout(90)

GUESSER = "127.0.0.2"  # another loopback address: another client host to the node


@pytest.fixture
def secured(node_factory, tmp_path):
    """A node with ``allow_anonymous = false``, users alice/bob in a mosquitto_passwd file,
    and at most 3 failed logins per address per minute."""
    pw = tmp_path / "passwords"
    for args in (["-c", "-b", str(pw), "alice", "wonderland"], ["-b", str(pw), "bob", "builder"]):
        done = subprocess.run(["mosquitto_passwd", *args], capture_output=True, timeout=10)
        assert done.returncode == 0, done.stderr
    conf = tmp_path / "node.toml"
    conf.write_text(f'allow_anonymous = false\npassword_file = "{pw}"\n'
                    "auth_failures_allowed = 3\nauth_failure_window = 60\n")
    node = node_factory()
    node.extra_args = ["--config", str(conf)]
    node.start()
    yield node
    assert node.terminate() == 0


def login(node, username: str | None, password: bytes | None, source: str | None = None,
          ) -> int:
    client = RawClient(node.handle.host, node.port, source=source, timeout=10)
    try:
        ack = client.connect(f"c-{time.monotonic_ns()}", username=username, password=password,
                             timeout=10)
        assert ack.return_code is not None
        return ack.return_code
    finally:
        client.close()


def test_logins_are_checked_against_the_mosquitto_passwd_file(secured):
    assert login(secured, "alice", b"wonderland") == 0
    assert login(secured, "bob", b"builder") == 0
    assert login(secured, "alice", b"builder") == 4, "wrong password: CONNACK 4"
    assert login(secured, "mallory", b"x") == 4, "unknown user: CONNACK 4"
    assert login(secured, None, None) == 5, "anonymous refused: CONNACK 5"
    log = secured.log_path.read_text()
    assert "bad username or password (user 'mallory')" in log and "from 127.0.0.1:" in log
    assert "builder" not in log.split("==== start")[-1], "no password reaches the log"


def test_a_guessing_client_is_limited_and_does_not_delay_others(secured):
    codes = [login(secured, "alice", f"guess{i}".encode(), GUESSER) for i in range(3)]
    assert codes == [4, 4, 4]
    # Budget used up: even the right password is refused unchecked from that address.
    assert login(secured, "alice", b"wonderland", GUESSER) == 5
    stop = threading.Event()
    guesses = [0]

    def guess() -> None:
        for i in range(2000):  # bounded; stopped by the event long before
            if stop.is_set():
                return
            with contextlib.suppress(OSError, TimeoutError):
                login(secured, "alice", f"x{i}".encode(), GUESSER)
            guesses[0] += 1

    guesser = threading.Thread(target=guess)
    guesser.start()
    try:
        worst = 0.0
        for _ in range(20):
            started = time.monotonic()
            assert login(secured, "bob", b"builder") == 0
            worst = max(worst, time.monotonic() - started)
    finally:
        stop.set()
        guesser.join(30)
    assert guesses[0] > 0
    assert worst < 3.0, f"a login took {worst:.2f}s while another address guessed"
    log = secured.log_path.read_text()
    assert f"failed logins from {GUESSER} reached 3" in log
    assert log.count(f"failed logins from {GUESSER}") == 1, "logged once, not per attempt"


def test_sighup_reloads_the_password_file(secured):
    """The lifecycle's SIGHUP re-reads the password file under the same path."""
    import signal

    pw = secured.data_dir.parent / "passwords"
    done = subprocess.run(["mosquitto_passwd", "-b", str(pw), "carol", "singer"],
                          capture_output=True, timeout=10)
    assert done.returncode == 0, done.stderr
    assert login(secured, "carol", b"singer") == 4, "not before the reload"
    secured.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while f"password file {pw} loaded: 3 users" not in secured.log_path.read_text():
        assert time.monotonic() < deadline, secured.log_tail()
        time.sleep(0.05)
    assert login(secured, "carol", b"singer") == 0


def passwd_and_reload(node, *args: str, users: int) -> None:
    """``mosquitto_passwd ARGS`` on the node's password file, then SIGHUP; returns once the
    node logged the file with ``users`` entries."""
    import signal

    pw = node.data_dir.parent / "passwords"
    done = subprocess.run(["mosquitto_passwd", *args[:-1], str(pw), *args[-1:]]
                          if args[0] == "-D" else ["mosquitto_passwd", "-b", str(pw), *args],
                          capture_output=True, timeout=10)
    assert done.returncode == 0, done.stderr
    loaded = f"password file {pw} loaded: {users} users"
    seen = node.log_path.read_text().count(loaded)
    node.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while node.log_path.read_text().count(loaded) <= seen:
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.05)


def test_a_username_without_a_password_is_refused(secured):
    """No password field is not an empty password: a user of the file whose password is
    "" must send it (CONNACK 4; MQTT 5: 0x86), as mosquitto refuses it too."""
    from mqtt5_support import Raw5
    from mqttring.protocol.codec5 import encode5
    from mqttring.protocol.packets5 import ConnAck5, Connect5

    passwd_and_reload(secured, "svc", "", users=3)
    assert login(secured, "svc", b"") == 0
    # From another address: three failures from one would use its budget up (limited).
    assert login(secured, "svc", None, GUESSER) == 4
    assert login(secured, "alice", None, GUESSER) == 4
    for password, code in ((None, 0x86), (b"", 0)):
        raw = Raw5(secured.handle.host, secured.port)
        try:
            raw.send(encode5(Connect5(f"v5-{code}", username="svc", password=password)))
            ack = raw.recv()
            assert isinstance(ack, ConnAck5) and ack.reason_code == code, ack
        finally:
            raw.close()


def test_sighup_disconnects_the_users_whose_password_went(secured):
    """A removed user and one whose password changed lose their connections at the reload
    (as mosquitto 2): an MQTT 5 client is told DISCONNECT 0x87 (not authorized) first.  A
    user whose entry is unchanged stays connected; the new password logs in."""
    from mqtt5_support import Raw5
    from mqttring.protocol.codec5 import encode5
    from mqttring.protocol.packets5 import ConnAck5, Connect5, Disconnect5

    passwd_and_reload(secured, "carol", "singer", users=3)
    alice = RawClient(secured.handle.host, secured.port, timeout=10)
    carol = RawClient(secured.handle.host, secured.port, timeout=10)
    bob = Raw5(secured.handle.host, secured.port)
    try:
        assert alice.connect("alice-1", username="alice", password=b"wonderland").return_code == 0
        assert carol.connect("carol-1", username="carol", password=b"singer").return_code == 0
        bob.send(encode5(Connect5("bob-1", username="bob", password=b"builder")))
        ack = bob.recv()
        assert isinstance(ack, ConnAck5) and ack.reason_code == 0, ack
        passwd_and_reload(secured, "alice", "looking-glass", users=3)
        assert alice.wait_closed(10), "alice's old password no longer holds a connection"
        passwd_and_reload(secured, "-D", "bob", users=2)
        goodbye = bob.recv()
        assert isinstance(goodbye, Disconnect5) and goodbye.reason_code == 0x87, goodbye
        assert bob.closed(10)
        carol.send(b"\xc0\x00")  # PINGREQ: carol's entry did not change
        assert carol.expect(13, 10).type == 13
    finally:
        for client in (alice, carol, bob):
            client.close()
    log = secured.log_path.read_text()
    for who, client_id in (("alice", "alice-1"), ("bob", "bob-1")):
        assert (f"client {client_id!r} disconnected (the password-file entry of user {who!r} "
                "was removed or changed)") in log, secured.log_tail()
    assert "client 'carol-1' disconnected (the password" not in log
    assert login(secured, "alice", b"looking-glass") == 0
    assert login(secured, "bob", b"builder") == 4
