"""What an operator reads in the log about clients: each connection, each disconnection with
its reason, each refused login, each takeover (issue 13, logging).  Real sockets against an
in-process broker; the log lines are what ``logging`` received from the broker's thread."""

from __future__ import annotations

import logging
import time

import pytest

from mqtt_client import DISCONNECT_BYTES, RawClient

pytestmark = pytest.mark.timeout(60)


def wait_for_line(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in caplog.records:
            message = record.getMessage()
            if text in message:
                assert record.levelno == logging.INFO, message
                return message
        time.sleep(0.02)
    raise AssertionError(f"no log line with {text!r}; got "
                         f"{[r.getMessage() for r in caplog.records][-10:]}")


def test_connections_and_their_ends_are_logged_with_reasons(broker_factory, raw, uid,
                                                            caplog):
    caplog.set_level(logging.INFO, logger="mqttring")
    b = broker_factory(ws=False)
    polite, rude, quiet, first = uid("polite"), uid("rude"), uid("quiet"), uid("same")
    client: RawClient = raw(b)
    assert client.connect(polite, keepalive=30).return_code == 0
    line = wait_for_line(caplog, f"client {polite!r} connected from 127.0.0.1:")
    assert "keepalive 30 s" in line
    client.send(DISCONNECT_BYTES)
    wait_for_line(caplog, f"client {polite!r} disconnected (DISCONNECT)")

    gone: RawClient = raw(b)
    assert gone.connect(rude, will=("wills/rude", b"x", 0, False)).return_code == 0
    gone.close()
    wait_for_line(caplog, f"client {rude!r} disconnected (connection closed by the client)")
    wait_for_line(caplog, f"publishing the will of {rude!r} on 'wills/rude': connection "
                          "closed by the client")

    silent: RawClient = raw(b)
    assert silent.connect(quiet, keepalive=1).return_code == 0
    wait_for_line(caplog, f"client {quiet!r} disconnected (keepalive timeout)")

    old: RawClient = raw(b)
    assert old.connect(first).return_code == 0
    new: RawClient = raw(b)
    assert new.connect(first).return_code == 0
    wait_for_line(caplog, f"client {first!r} disconnected (taken over by a new connection)")


def test_a_refused_login_is_logged(tmp_path, uid, caplog):
    from mqttring import BrokerConfig, MqttRingBroker
    from mqttring.security.passwords import format_entries, hash_password

    caplog.set_level(logging.INFO, logger="mqttring")
    passwords = tmp_path / "passwords"
    passwords.write_text(format_entries([("alice", hash_password(b"right"))]))
    broker = MqttRingBroker(BrokerConfig(mqtt="127.0.0.1:0", ws=None, data_dir=tmp_path,
                                         sys_interval=0, allow_anonymous=False,
                                         password_file=passwords))
    ports = broker.start()
    try:
        client = RawClient("127.0.0.1", ports.mqtt)
        who = uid("intruder")
        assert client.connect(who, username="alice", password=b"wrong").return_code == 4
        line = wait_for_line(caplog, f"refusing client {who!r} from 127.0.0.1:")
        assert "bad username or password" in line and "'alice'" in line
        assert "wrong" not in line, "a password never reaches the log"
        client.close()
    finally:
        broker.stop()
