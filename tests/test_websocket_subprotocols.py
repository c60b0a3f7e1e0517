"""WebSocket subprotocol negotiation with MQTT 3.1 clients, over real sockets.

MQTT 3.1.1 names the subprotocol "mqtt" [MQTT-6.0.0-3]; MQTT 3.1 clients (MQTT.js with
``protocolId: 'MQIsdp', protocolVersion: 3``, older paho) offer only "mqttv3.1", and abort
the handshake when the 101 answer echoes no subprotocol.  mosquitto accepts and echoes it;
so must we, and a client offering both gets "mqtt".  Each case then speaks MQTT 3.1
(CONNECT with protocol name ``MQIsdp``, level 3) and reads its CONNACK, so the connection is
proven usable, not just upgraded.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from trio_websocket import open_websocket_url

from mqtt_client import CONNACK, StreamDecoder, connect
from ws_support import server_cert

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def broker(tmp_path: Path, ca: trustme.CA) -> AsyncIterator[Any]:
    """An in-process node with ``ws`` and ``wss`` listeners on free ports."""
    from mqttring import BrokerConfig, MqttRingBroker

    cert, key = server_cert(ca, tmp_path)
    config = BrokerConfig(node_id="ws-subprotocols", mqtt=f"{HOST}:0", ws=f"{HOST}:0",
                          wss=f"{HOST}:0", certfile=cert, keyfile=key, data_dir=None,
                          sys_interval=0)
    async with MqttRingBroker(config) as node:
        yield node


async def _connack_over(url: str, offered: list[str], ssl_context: ssl.SSLContext | None,
                        ) -> tuple[str | None, int]:
    """Upgrade offering ``offered``, send an MQTT 3.1 CONNECT; (echoed subprotocol, CONNACK
    return code)."""
    decoder = StreamDecoder()
    with trio.fail_after(10):
        async with open_websocket_url(url, ssl_context=ssl_context,
                                      subprotocols=offered) as ws:
            await ws.send_message(connect("mqtt31-client", protocol_name="MQIsdp",
                                          protocol_level=3))
            while (packet := decoder.next_packet()) is None:
                message = await ws.get_message()
                assert isinstance(message, bytes)
                decoder.feed(message)
            assert packet.type == CONNACK
            return ws.subprotocol, packet.return_code


@pytest.mark.parametrize(("offered", "echoed"), [
    (["mqttv3.1"], "mqttv3.1"),
    (["mqttv3.1", "mqtt"], "mqtt"),
    (["x-unknown", "mqtt"], "mqtt"),
])
async def test_wss_echoes_the_mqtt_subprotocol_offered(broker: Any, ca: trustme.CA,
                                                       offered: list[str], echoed: str) -> None:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    url = f"wss://{HOST}:{broker.ports.wss}/mqtt"
    assert await _connack_over(url, offered, context) == (echoed, 0)


async def test_ws_echoes_mqttv31_to_an_mqtt31_client(broker: Any) -> None:
    url = f"ws://{HOST}:{broker.ports.ws}/mqtt"
    assert await _connack_over(url, ["mqttv3.1"], None) == ("mqttv3.1", 0)
