"""The two ways to run a broker (issue 2 "Interfaces"): the node process and the embedded
``MqttRingBroker`` inside a trio program, each checked with a real MQTT exchange."""

from __future__ import annotations

import signal

import pytest
import trio

from mqtt_client import CONNACK, PUBLISH, SUBACK, StreamDecoder, connect, publish, subscribe

pytestmark = pytest.mark.timeout(60)


def test_node_process_tcp_and_websocket_then_sigint(node_factory, paho_any, uid):
    """The ready file names both listeners; both serve MQTT; SIGINT shuts down with exit 0."""
    node = node_factory(ws=True)
    handle = node.start()
    assert handle.ws_port, "--ws given but the ready file has no ws port"
    topic = uid("node")
    tcp = paho_any(handle, uid("tcp"))
    tcp.connect()
    tcp.subscribe(topic, 1)
    ws = paho_any(handle, uid("ws"), transport="websockets")
    ws.connect()
    ws.publish(topic, b"via-ws", qos=1)
    assert tcp.get().payload == b"via-ws"
    ws.close()
    tcp.close()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(15) == 0, f"exit code after SIGINT:\n{node.log_tail()}"


async def _mqtt_round_trip(port: int, client_id: str) -> None:
    """CONNECT, SUBSCRIBE, PUBLISH to itself over a trio TCP stream, bounded by fail_after."""
    decoder = StreamDecoder()
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(connect(client_id))
            await stream.send_all(subscribe(1, [("emb/t", 0)]))
            await stream.send_all(publish("emb/t", b"hello"))
            types: list[int] = []
            while PUBLISH not in types:
                chunk = await stream.receive_some(65536)
                assert chunk, "broker closed the connection"
                decoder.feed(chunk)
                while (pkt := decoder.next_packet()) is not None:
                    types.append(pkt.type)
                    if pkt.type == PUBLISH:
                        assert pkt.payload == b"hello"
            assert types[:2] == [CONNACK, SUBACK]


async def test_embedded_with_nursery_start(tmp_path):
    from mqttring import BrokerConfig, MqttRingBroker

    config = BrokerConfig(
        node_id="emb1", mqtt="127.0.0.1:0", data_dir=tmp_path, sys_interval=0
    )
    broker = MqttRingBroker(config)
    async with trio.open_nursery() as nursery:
        ports = await nursery.start(broker.serve)
        assert ports.mqtt and ports.ws is None
        await _mqtt_round_trip(ports.mqtt, "emb1")
        nursery.cancel_scope.cancel()


async def test_embedded_async_with(tmp_path):
    from mqttring import BrokerConfig, MqttRingBroker

    config = BrokerConfig(
        node_id="emb2", mqtt="127.0.0.1:0", data_dir=tmp_path, sys_interval=0
    )
    with trio.fail_after(20):
        async with MqttRingBroker(config) as broker:
            await _mqtt_round_trip(broker.ports.mqtt, "emb2")


def test_documented_sample_config_is_valid(tmp_path):
    """The TOML sample in docs/configuration.md loads as it is (no drift from the code)."""
    from pathlib import Path

    from mqttring.config import BrokerConfig

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    sample = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "node.toml"
    path.write_text(sample)
    config = BrokerConfig.from_toml(path)
    assert config.node_id == "edge-1" and config.gc_full_every == 100


def test_node_tunes_the_collector_of_its_own_process():
    import gc

    from mqttring.config import BrokerConfig, ConfigError
    from mqttring.node import tune_gc

    saved = gc.get_threshold()
    try:
        tune_gc(BrokerConfig(gc_full_every=37))
        assert gc.get_threshold() == (saved[0], saved[1], 37)
    finally:
        gc.set_threshold(*saved)
    with pytest.raises(ConfigError, match="gc_full_every"):
        BrokerConfig(gc_full_every=0)


@pytest.mark.parametrize("module", ["mqttring.cli", "mqttring.node"])
def test_version_is_printed_and_exits_zero(module):
    import subprocess
    import sys

    from mqttring import __version__

    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"mqttring {__version__}"
