"""mosquitto_pub / mosquitto_sub (Debian mosquitto-clients) against the broker."""

from __future__ import annotations

import subprocess

import pytest

from mqtt_client import read_until

pytestmark = pytest.mark.timeout(90)

FORMAT = "MSG|%q|%r|%t|%p"


def start_sub(
    processes, broker, topic: str, qos: int, count: int, *extra: str,
    ready: bytes = b"received SUBACK",
):
    """mosquitto_sub printing one ``MSG|qos|retain|topic|payload`` line per message; returns
    the process and what it printed up to ``ready`` (by default its SUBACK, so the
    subscription is in place)."""
    proc = processes([
        "stdbuf", "-oL", "mosquitto_sub", "-h", broker.host, "-p", str(broker.port),
        "-t", topic, "-q", str(qos), "-C", str(count), "-W", "15", "-d", "-F", FORMAT, *extra,
    ])  # fmt: skip
    return proc, read_until(proc, ready, timeout=10)


def finish_sub(proc, head: bytes) -> list[tuple[int, bool, str, str]]:
    out, _ = proc.communicate(timeout=20)
    lines = (head + out).decode(errors="replace").splitlines()
    result = []
    for line in lines:
        if line.startswith("MSG|"):
            _, q, r, t, p = line.split("|", 4)
            result.append((int(q), r == "1", t, p))
    return result


def pub(broker, topic: str, message: str | None, qos: int = 0, retain: bool = False) -> None:
    cmd = ["mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-t", topic, "-q", str(qos)]
    cmd += ["-n"] if message is None else ["-m", message]
    if retain:
        cmd.append("-r")
    done = subprocess.run(cmd, capture_output=True, timeout=15)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("sub_qos", [0, 1, 2])
def test_cli_qos_matrix(broker, processes, uid, sub_qos):
    """mosquitto_pub at QoS 0/1/2 -> mosquitto_sub at ``sub_qos``: delivered QoS is the min
    [MQTT-3.8.4-6], live messages carry RETAIN=0 [MQTT-3.3.1-9]."""
    topic = uid("cli")
    proc, head = start_sub(processes, broker, topic, sub_qos, 3)
    for q in (0, 1, 2):
        pub(broker, topic, f"p{q}", qos=q)
    got = finish_sub(proc, head)
    assert sorted(got) == sorted(
        (min(q, sub_qos), False, topic, f"p{q}") for q in (0, 1, 2)
    ), got
    assert proc.returncode == 0


def test_cli_retained_set_late_subscriber_clear(broker, processes, uid):
    """[MQTT-3.3.1-6]/[MQTT-3.3.1-8] late subscriber gets RETAIN=1; [MQTT-3.3.1-10] cleared."""
    topic = uid("cliret")
    pub(broker, topic, "first", qos=1, retain=True)
    pub(broker, topic, "second", qos=2, retain=True)
    proc, head = start_sub(processes, broker, topic, 2, 1)
    assert finish_sub(proc, head) == [(2, True, topic, "second")]
    pub(broker, topic, None, qos=1, retain=True)  # -n: zero-length retained message clears
    proc, head = start_sub(processes, broker, topic, 1, 1, "-W", "2")
    assert finish_sub(proc, head) == [], "retained message not cleared"


def test_cli_to_paho_and_paho_to_cli(broker, paho, processes, uid):
    """Both directions between different client libraries, QoS 2 end to end."""
    topic = uid("mix")
    p = paho(uid("paho"))
    p.connect()
    p.subscribe(f"{topic}/to-paho", 2)
    pub(broker, f"{topic}/to-paho", "from-cli", qos=2)
    m = p.get()
    assert (m.payload, m.qos, m.retain) == (b"from-cli", 2, False)
    proc, head = start_sub(processes, broker, f"{topic}/to-cli", 2, 1)
    p.publish(f"{topic}/to-cli", b"from-paho", qos=2)
    assert finish_sub(proc, head) == [(2, False, f"{topic}/to-cli", "from-paho")]


@pytest.mark.parametrize("qos", [1, 2])
def test_cli_persistent_session(broker, processes, uid, qos):
    """mosquitto_sub -c (CleanSession=0) -i ID: messages published while it is away are
    delivered when it comes back [MQTT-3.1.2-5], in order (4.6).  At QoS 2 each PUBREL of
    the stored session waits for its PUBREC's durable record: libmosquitto hands the
    message over on PUBREL, so each arrives once, and all five do."""
    topic, cid = uid("clip"), uid("clip")
    proc, head = start_sub(processes, broker, topic, qos, 1, "-c", "-i", cid, "-W", "1")
    assert finish_sub(proc, head) == []
    for i in range(5):
        pub(broker, topic, f"q{i}", qos=qos)
    # The queued messages may arrive (and -C 5 exit) before the SUBACK: wait for CONNACK only.
    proc, head = start_sub(
        processes, broker, topic, qos, 5, "-c", "-i", cid, ready=b"received CONNACK"
    )
    got = finish_sub(proc, head)
    assert [(q, t, p) for q, _, t, p in got] == [(qos, topic, f"q{i}") for i in range(5)]
