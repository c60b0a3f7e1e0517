"""Test clients for MQTT 5.0: a paho MQTTv5 wrapper with bounded waits, and a raw-socket
client speaking our own v5 codec (for bytes no well-behaved client would send)."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

from mqttring.protocol.codec5 import PacketDecoder5, encode5
from mqttring.protocol.packets5 import Connect5, Packet5
from mqttring.protocol.properties import Properties, PropertyId

WAIT = 10.0


class Paho5:
    """A paho-mqtt client speaking MQTT 5.0; everything it receives lands in queues."""

    def __init__(self, host: str, port: int, client_id: str = "", transport: str = "tcp"
                 ) -> None:
        import paho.mqtt.client as mqtt

        self.host, self.port = host, port
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=mqtt.MQTTv5, reconnect_on_failure=False,
                                  transport=transport)  # type: ignore[arg-type]
        self.messages: queue.Queue[Any] = queue.Queue()
        self.connacks: queue.Queue[tuple[bool, int, Any]] = queue.Queue()
        self.subacks: queue.Queue[tuple[int, list[int]]] = queue.Queue()
        self.unsubacks: queue.Queue[tuple[int, list[int]]] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        self.disconnected = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: self.connacks.put(
            (bool(f.session_present), int(rc.value), p))
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.subacks.put(
            (mid, [int(rc.value) for rc in rcs]))
        self.client.on_unsubscribe = lambda c, u, mid, rcs, p: self.unsubacks.put(
            (mid, [int(rc.value) for rc in rcs]))
        self.client.on_disconnect = self._on_disconnect

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any
                       ) -> None:
        self.disconnects.put(int(rc.value))
        self.disconnected.set()

    def connect(self, clean_start: bool = True, properties: Any = None,
                will: tuple[str, bytes, int, bool, Any] | None = None,
                keepalive: int = 30) -> tuple[bool, Any]:
        """Connect, expect CONNACK success; returns (session present, CONNACK properties)."""
        if will is not None:
            topic, payload, qos, retain, will_props = will
            self.client.will_set(topic, payload, qos, retain, properties=will_props)
        self.disconnected.clear()
        self.client.connect(self.host, self.port, keepalive, clean_start=clean_start,
                            properties=properties)
        self.client.loop_start()
        present, rc, props = self.connacks.get(timeout=WAIT)
        assert rc == 0, f"CONNACK refused: {rc:#x}"
        return present, props

    def subscribe(self, topic: str, qos: int = 0, properties: Any = None,
                  **options: Any) -> list[int]:
        from paho.mqtt.subscribeoptions import SubscribeOptions

        result, mid = self.client.subscribe(topic, options=SubscribeOptions(qos=qos, **options),
                                            properties=properties)
        assert result == 0
        got, codes = self.subacks.get(timeout=WAIT)
        assert got == mid
        return codes

    def unsubscribe(self, topic: str) -> list[int]:
        result, mid = self.client.unsubscribe(topic)
        assert result == 0
        got, codes = self.unsubacks.get(timeout=WAIT)
        assert got == mid
        return codes

    def publish(self, topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False,
                properties: Any = None) -> None:
        info = self.client.publish(topic, payload, qos, retain, properties=properties)
        info.wait_for_publish(timeout=WAIT)
        assert info.is_published()

    def get(self, timeout: float = WAIT) -> Any:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no message within {timeout}s") from None

    def nothing_before(self, sentinel_topic: str, timeout: float = WAIT) -> None:
        """Every message until one on ``sentinel_topic`` arrives must be that one."""
        message = self.get(timeout)
        assert message.topic == sentinel_topic, f"unexpected {message.topic}: {message.payload}"

    def disconnect(self, properties: Any = None) -> None:
        self.client.disconnect(properties=properties)
        self.disconnected.wait(WAIT)
        self.client.loop_stop()

    def drop(self) -> None:
        """Close the socket without DISCONNECT (the will is owed)."""
        self.client.loop_stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()


def props(packet_type: int, **values: Any) -> Any:
    from paho.mqtt.properties import Properties as PahoProperties

    p = PahoProperties(packet_type)
    for name, value in values.items():
        setattr(p, name, value)
    return p


class Raw5:
    """A raw MQTT 5.0 client on a socket: sends what it is told, decodes what comes back."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=WAIT)
        self.decoder = PacketDecoder5()

    def connect(self, client_id: str, clean_start: bool = True, keepalive: int = 60,
                **properties: int) -> Packet5:
        items = [(PropertyId[k.upper()], v) for k, v in properties.items()]
        self.send(encode5(Connect5(client_id, clean_start, keepalive,
                                   properties=Properties(items))))
        return self.recv()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = WAIT) -> Packet5:
        deadline = time.monotonic() + timeout
        while True:
            packet = self.decoder.next_packet()
            if packet is not None:
                return packet
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by the broker")
            self.decoder.feed(data)

    def closed(self, timeout: float = WAIT) -> bool:
        """True once the broker closed the connection (after whatever it sent)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except (ConnectionResetError, TimeoutError):
            return False
        return True

    def close(self) -> None:
        self.sock.close()
