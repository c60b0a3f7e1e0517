"""Run mqttring in a background thread of a plain Python program, use it with paho-mqtt.

    python docs/examples/embed_thread.py
"""

from __future__ import annotations

import queue
import tempfile
from pathlib import Path

import paho.mqtt.client as mqtt

from mqttring import BrokerConfig, MqttRingBroker


def main() -> None:
    broker = MqttRingBroker(BrokerConfig(mqtt="127.0.0.1:0", data_dir=Path(tempfile.mkdtemp())))
    ports = broker.start()  # returns once the node listens
    try:
        received: queue.Queue[str] = queue.Queue()
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        client.on_message = lambda _c, _u, msg: received.put(msg.payload.decode())
        client.connect("127.0.0.1", ports.mqtt)
        client.loop_start()
        client.subscribe("greetings/#", qos=1)[0]
        client.publish("greetings/world", "hello from a thread", qos=1, retain=True)
        print(received.get(timeout=10))
        client.disconnect()
        client.loop_stop()
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
