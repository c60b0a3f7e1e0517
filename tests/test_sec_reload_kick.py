"""``BrokerCore.reload_security`` called by an embedder from its own thread (not trio's):
the connections of a user whose password-file entry changed are closed on the event loop."""

from __future__ import annotations

import pytest

from mqtt_client import RawClient

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("settings_reload_first", [False, True],
                         ids=["file-reload", "after-a-login-setting-reload"])
def test_reload_from_a_foreign_thread_closes_revoked_logins(tmp_path, settings_reload_first):
    """``after-a-login-setting-reload``: a reload that changed a login setting
    (``auth_failures_allowed``) swaps in a new authenticator; a password-file reload after
    it, with no login in between, closed nobody: the event loop's token was the old
    authenticator's, set at its first login check, so the close from the reload's thread was
    dropped without a word (a black-box probe, 2 of 2).  Now the core holds the token of
    the loop it was built in."""
    import dataclasses

    from mqttring import BrokerConfig, MqttRingBroker
    from mqttring.security.passwords import format_entries, hash_password

    pw = tmp_path / "passwords"
    carol = ("carol", hash_password(b"c-pw"))
    pw.write_text(format_entries([("alice", hash_password(b"a-pw")), carol]))
    config = BrokerConfig(mqtt="127.0.0.1:0", ws=None, data_dir=tmp_path / "d", sys_interval=0,
                          allow_anonymous=False, password_file=pw)
    broker = MqttRingBroker(config)
    ports = broker.start()
    alice = RawClient("127.0.0.1", ports.mqtt, timeout=10)
    stays = RawClient("127.0.0.1", ports.mqtt, timeout=10)
    try:
        assert alice.connect("a1", username="alice", password=b"a-pw").return_code == 0
        assert stays.connect("c1", username="carol", password=b"c-pw").return_code == 0
        assert broker.core is not None
        if settings_reload_first:
            broker.core.apply_settings(dataclasses.replace(config, auth_failures_allowed=5))
        pw.write_text(format_entries([carol]))  # alice removed, carol's entry as it was
        broker.core.reload_security()  # this thread is not trio's
        assert alice.wait_closed(10)
        stays.send(b"\xc0\x00")  # PINGREQ
        assert stays.expect(13, 10).type == 13
    finally:
        alice.close()
        stays.close()
        broker.stop()
