"""Run mqttring inside a trio program and talk to it over a raw socket.

    python docs/examples/embed_trio.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import trio

from mqttring import BrokerConfig, MqttRingBroker
from mqttring.protocol.codec import PacketDecoder, encode
from mqttring.protocol.packets import Connect, Publish, Subscribe


async def main() -> None:
    config = BrokerConfig(mqtt="127.0.0.1:0", data_dir=Path(tempfile.mkdtemp()))
    async with MqttRingBroker(config) as broker:
        assert broker.ports is not None
        stream = await trio.open_tcp_stream("127.0.0.1", broker.ports.mqtt)
        await stream.send_all(
            encode(Connect("example", keepalive=30))
            + encode(Subscribe(1, (("greetings/#", 0),)))
            + encode(Publish("greetings/world", b"hello from trio"))
        )
        decoder = PacketDecoder()
        while True:
            decoder.feed(await stream.receive_some(4096))
            for packet in decoder:
                if isinstance(packet, Publish):
                    print(f"{packet.topic}: {packet.payload.decode()}")
                    await stream.aclose()
                    return


if __name__ == "__main__":
    trio.run(main)
