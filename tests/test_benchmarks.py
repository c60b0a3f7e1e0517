"""Smoke test of the benchmark harness, plus the generator's frame walker on byte literals.

Why a smoke test at all: the harness only runs when someone benchmarks, so a broken
generator would otherwise be found on the day figures are needed.  It drives the real CLI
(``python -m benchmarks compare --quick --target``) for a few seconds against an in-process
mqttring broker and checks the JSON it writes: non-zero figures, zero QoS 1 loss.
"""

from __future__ import annotations

import json
import time

import pytest
from benchmarks import wire
from benchmarks.__main__ import main as bench_main


def test_golden_bytes():
    assert wire.connect("c") == b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x00\x00\x01c"
    assert wire.publish("a/b", b"hi") == b"\x30\x07\x00\x03a/bhi"
    assert wire.publish("t", b"x", 1, 258, retain=True) == b"\x33\x06\x00\x01t\x01\x02x"
    assert wire.subscribe(1, ["a/#"], 1) == b"\x82\x08\x00\x01\x00\x03a/#\x01"
    assert wire.encode_remaining_length(321) == b"\xc1\x02"


def test_walkers_count_whole_frames_only_wherever_the_stream_is_split():
    big = wire.publish("t", b"y" * 300)  # two-byte remaining length
    stream = (wire.publish("t/1", b"x" * 64) + big) * 5 + b"\x40\x02\x00\x07"
    for cut in range(len(stream) + 1):
        buf = bytearray(stream[:cut])
        n, used = wire.count_publishes(buf, 0, len(buf))
        rest = bytearray(buf[used:] + stream[cut:])
        m, used2 = wire.count_publishes(rest, 0, len(rest))
        assert n + m == 10 and used2 == len(rest)


def test_qos1_walker_acks_each_packet_id():
    frames = b"".join(wire.publish("q", b"p", 1, pid) for pid in (1, 300, 65535))
    out = bytearray()
    n, dups, used = wire.ack_publishes(bytearray(frames), 0, len(frames), out)
    assert (n, dups, used) == (3, 0, len(frames))
    assert bytes(out) == wire.puback(1) + wire.puback(300) + wire.puback(65535)


@pytest.mark.timeout(60)
def test_quick_compare_against_in_process_mqttring(tmp_path):
    import mqttring
    broker = mqttring.MqttRingBroker(
        mqttring.BrokerConfig(mqtt="127.0.0.1:0", data_dir=tmp_path / "data", sys_interval=0)
    )
    ports = broker.start()
    t0 = time.monotonic()
    try:
        rc = bench_main(
            [
                "compare",
                "--quick",
                "--no-sink",
                "--out",
                str(tmp_path / "out"),
                "--target",
                f"mqttring=127.0.0.1:{ports.mqtt}",
                "--scenarios",
                "fanin_qos0,fanin_qos1,latency",
            ]
        )
    finally:
        broker.stop()
    assert rc == 0
    assert time.monotonic() - t0 < 30
    (result_file,) = (tmp_path / "out").glob("*.json")
    results = json.loads(result_file.read_text())
    assert (tmp_path / "out" / result_file.name.replace(".json", ".md")).exists()
    scen = results["brokers"]["mqttring"]["scenarios"]
    for name in ("fanin_qos0", "fanin_qos1"):
        assert scen[name]["status"] == "ok", scen[name]
        assert scen[name]["deliveries_per_s"] > 100
        assert scen[name]["received"] > 0
    assert scen["fanin_qos1"]["lost"] == 0
    assert scen["fanin_qos1"]["acked"] == scen["fanin_qos1"]["sent"]
    assert scen["latency"]["status"] == "ok"
    assert 0 < scen["latency"]["p50_ms"] <= scen["latency"]["p99_ms"] < 1000
    assert results["machine"]["cores_logical"] >= 1


def test_a_reference_that_lost_messages_is_still_compared_with_its_loss_said():
    """mosquitto failing fan-in QoS 1 only because it lost acknowledged messages still gives
    the rate mqttring is measured against (the report says so); mqttring losing any fails."""
    from benchmarks.report import targets

    def run(mine: dict, theirs: dict) -> dict:
        results = {"brokers": {"mqttring": {"scenarios": {"fanin_qos1": mine}},
                               "mosquitto": {"scenarios": {"fanin_qos1": theirs}}}}
        (verdict,) = [t for t in targets(results) if t["target"].startswith("fan-in QoS 1")]
        return verdict

    lossy = {"status": "failed", "deliveries_per_s": 120000.0, "lost": 364,
             "error": "QoS 1 loss: 364 acknowledged deliveries never arrived"}
    verdict = run({"status": "ok", "deliveries_per_s": 80000.0, "lost": 0}, lossy)
    assert verdict["met"] is True and verdict["value"] == 0.67
    assert "mosquitto lost 364 acknowledged messages" in verdict["detail"]
    mine_lossy = run({"status": "failed", "deliveries_per_s": 80000.0, "lost": 1,
                      "error": "QoS 1 loss"}, lossy)
    assert mine_lossy["met"] is False
    broken = {"status": "failed", "error": "broker died"}  # no rate at all: not evaluated
    assert run({"status": "ok", "deliveries_per_s": 80000.0, "lost": 0}, broken)["met"] is None
