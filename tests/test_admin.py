"""The node's admin RPC: stats and a snapshot taken while the node serves; secret required."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
import trio

from mqttring import BrokerConfig, MqttRingBroker
from mqttring.lsm import open_snapshot
from mqttring.rpc import RPC_KEY_PURPOSE, AuthError, RpcError, call_once, derive_key

SECRET = "admin-test-secret"


@pytest.fixture
def node(tmp_path):
    broker = MqttRingBroker(BrokerConfig(
        node_id="solo", mqtt="127.0.0.1:0", admin="127.0.0.1:0", cluster_secret=SECRET,
        data_dir=tmp_path / "data", sys_interval=0,
    ))
    ports = broker.start()
    yield broker, ports
    broker.stop()


def publish_retained(port: int, n: int) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    for i in range(n):
        client.publish(f"r/{i}", b"v%d" % i, qos=1, retain=True).wait_for_publish(10)
    client.disconnect()
    client.loop_stop()


async def test_snapshot_and_stats_over_the_admin_rpc(node, tmp_path):
    broker, ports = node
    await trio.to_thread.run_sync(publish_retained, ports.mqtt, 25)
    key = derive_key(SECRET, RPC_KEY_PURPOSE)
    address = f"127.0.0.1:{broker.admin_port}"
    stats = await call_once(address, key, "test", "stats")
    assert stats["node_id"] == "solo"
    assert stats["metrics"]["messages_received"] == 25
    reply = await call_once(address, key, "test", "snapshot", {"out": str(tmp_path / "snap")})
    snapshot = open_snapshot(reply["path"])
    assert snapshot.manifest.rows["retained"] == 25
    with pytest.raises(RpcError):  # the same directory twice would mix two snapshots
        await call_once(address, key, "test", "snapshot", {"out": str(tmp_path / "snap")})


async def test_wrong_secret_is_refused(node):
    broker, _ = node
    with pytest.raises(AuthError):
        await call_once(f"127.0.0.1:{broker.admin_port}", derive_key("wrong", RPC_KEY_PURPOSE),
                        "test", "stats")
