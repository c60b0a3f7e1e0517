"""``mqttring.broker.files.NodeFiles``: a node reads its password and ACL files once, and the
broker it hands them to serves with what was loaded (no second read at start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from mqttring import BrokerConfig, MqttRingBroker
from mqttring.broker.files import NodeFiles
from mqttring.config import ConfigError
from mqttring.security.passwords import format_entries, hash_password

pytestmark = pytest.mark.timeout(60)


def security_config(tmp_path: Path) -> BrokerConfig:
    passwords = tmp_path / "pw"
    passwords.write_text(format_entries([("alice", hash_password(b"a-pw", iterations=1000))]))
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic readwrite alice/#\n")
    return BrokerConfig(node_id="files", mqtt="127.0.0.1:0", ws=None, data_dir=tmp_path / "d",
                        sys_interval=0, password_file=passwords, acl_file=acl)


def test_load_reads_the_named_files_and_nothing_else(tmp_path: Path) -> None:
    files = NodeFiles.load(security_config(tmp_path))
    assert files.passwords is not None and files.passwords.get("alice") is not None
    assert files.acl is not None
    assert (files.tls, files.cluster_tls) == (None, None)
    assert NodeFiles.load(BrokerConfig()) == NodeFiles(None, None, None, None)


def test_a_bad_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    config = security_config(tmp_path)
    config.acl_file.write_text("topic read a/#\nbogus line\n")  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=f"{config.acl_file}:2"):
        NodeFiles.load(config)


async def test_the_broker_serves_with_the_files_it_was_handed(tmp_path: Path) -> None:
    config = security_config(tmp_path)
    files = NodeFiles.load(config)
    # Gone from disk: a broker that read them again would fail to start.
    config.password_file.unlink()  # type: ignore[union-attr]
    config.acl_file.unlink()  # type: ignore[union-attr]
    with trio.fail_after(20):
        async with MqttRingBroker(config, files=files) as broker:
            assert broker.core is not None and broker.core.acl is not None
            assert broker.core.acl.current is files.acl
            assert broker.core.auth._snapshot is not None
            assert broker.core.auth._snapshot.passwords is files.passwords
    with pytest.raises(ConfigError, match="cannot read password file"):
        async with MqttRingBroker(config):  # handed nothing: it loads, and fails
            pass
