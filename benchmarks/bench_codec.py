"""Micro-benchmarks for the sans-IO codec, a QoS 1 message's protocol steps and the topic trees.

Run as ``python benchmarks/bench_codec.py`` (or ``python -m benchmarks.bench_codec``); prints a
table and writes ``benchmarks/results/codec.json``.  Each figure is the best of several
repetitions, because on a shared machine the minimum is the least noisy estimate of what the
code costs.  The decode figures feed 64 KiB chunks, as a TCP read would deliver them, so they
include buffering and chunk-boundary handling, not just parsing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from mqttring.protocol.codec import PacketDecoder, encode, encode_publish, publish_with_packet_id
from mqttring.protocol.connection import ServerConnection
from mqttring.protocol.packets import Connect, PubAck, Publish
from mqttring.protocol.session import Session
from mqttring.protocol.topics import TopicIndex, TopicTrie

RESULTS = Path(__file__).resolve().parent / "results" / "codec.json"
CHUNK = 65536


def best_rate(operations: int, run: Callable[[], object], repeat: int) -> float:
    """Operations per second of the fastest of ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return operations / best


def publish_stream(count: int, qos: int, payload_size: int = 64) -> bytes:
    payload = bytes(range(payload_size))
    return b"".join(
        encode_publish(
            f"sensors/{i % 500}/temperature".encode(),
            payload,
            qos,
            False,
            False,
            (i % 65535) + 1 if qos else None,
        )
        for i in range(count)
    )


def bench_decode(count: int, qos: int, repeat: int) -> dict[str, float]:
    stream = publish_stream(count, qos)
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]

    def run() -> None:
        decoder = PacketDecoder()
        decoded = 0
        for chunk in chunks:
            decoder.feed(chunk)
            for _packet in decoder:
                decoded += 1
        assert decoded == count

    rate = best_rate(count, run, repeat)
    return {"packets_per_s": rate, "mbytes_per_s": rate * len(stream) / count / 1e6}


def bench_encode(count: int, repeat: int) -> dict[str, float]:
    topic = b"sensors/42/temperature"
    payload = bytes(64)
    qos0 = encode_publish(topic, payload, 0, False, False, None)

    def run_encode() -> None:
        for i in range(count):
            encode_publish(topic, payload, 1, False, False, (i & 0xFFFF) | 1)

    def run_stamp() -> None:
        for i in range(count):
            publish_with_packet_id(qos0, 1, (i & 0xFFFF) | 1)

    return {
        "encode_publish_qos1_per_s": best_rate(count, run_encode, repeat),
        "publish_with_packet_id_per_s": best_rate(count, run_stamp, repeat),
    }


def wildcard_filters(count: int, rng: random.Random) -> list[str]:
    """A mix of the shapes real deployments use: per-device, per-metric, catch-alls."""
    shapes = [
        lambda: f"sensors/{rng.randrange(500)}/+",
        lambda: f"sensors/+/{rng.choice(['temperature', 'humidity', 'pressure'])}",
        lambda: f"sensors/{rng.randrange(500)}/#",
        lambda: f"home/{rng.randrange(200)}/+/state",
        lambda: f"+/{rng.randrange(500)}/temperature",
        lambda: f"fleet/{rng.randrange(100)}/+/gps/#",
    ]
    filters: set[str] = set()
    while len(filters) < count:
        filters.add(rng.choice(shapes)())
    return sorted(filters)


def bench_trie(filter_count: int, topic_count: int, repeat: int) -> dict[str, float]:
    rng = random.Random(1)
    trie: TopicTrie[str, int] = TopicTrie()
    for i, topic_filter in enumerate(wildcard_filters(filter_count, rng)):
        trie.add(topic_filter, f"client-{i}", i % 3)
    topics = [
        rng.choice(
            [
                f"sensors/{rng.randrange(500)}/temperature",
                f"home/{rng.randrange(200)}/light/state",
                f"fleet/{rng.randrange(100)}/truck{rng.randrange(50)}/gps/fix",
                f"other/{rng.randrange(1000)}/x",
            ]
        )
        for _ in range(topic_count)
    ]
    matched = sum(len(trie.match(t)) for t in topics)
    match = trie.match

    def run() -> None:
        for topic in topics:
            match(topic)

    return {
        "filters": float(len(trie)),
        "matches_per_s": best_rate(topic_count, run, repeat),
        "avg_subscribers_per_topic": matched / topic_count,
    }


def bench_index(topic_count: int, queries: int, repeat: int) -> dict[str, float]:
    index: TopicIndex[int] = TopicIndex()
    for i in range(topic_count):
        index.set(f"sensors/{i % 1000}/metric{i // 1000}", i)
    # Each filter selects 10 of the retained topics, as a per-device subscription would.
    filters = [f"sensors/{i % 1000}/+" for i in range(queries)]

    def run() -> None:
        for topic_filter in filters:
            for _ in index.match(topic_filter):
                pass

    return {"retained": float(len(index)), "filter_matches_per_s": best_rate(queries, run, repeat)}


def bench_qos1_round(messages: int, repeat: int, batch: int = 16) -> dict[str, float]:
    """What one QoS 1 message costs the protocol layer of a broker, sockets and routing
    aside: its publisher's PUBLISH decoded into an event and PUBACKed, the copy handed to
    an online subscriber's session and encoded, and that subscriber's PUBACK applied; in
    batches of ``batch``, as one TCP read delivers them."""

    def connected(client_id: str) -> ServerConnection:
        conn = ServerConnection()
        conn.receive_data(encode(Connect(client_id, clean_session=True)))
        conn.accept(Session(client_id, True), session_present=False)
        conn.data_to_send()
        return conn

    publisher, subscriber = connected("pub"), connected("sub")
    session = subscriber.session
    assert session is not None
    payload = bytes(64)
    rounds = max(1, messages // batch)
    chunks = [b"".join(encode(Publish("sensors/42/temperature", payload, qos=1,
                                      packet_id=(r * batch + i) % 65535 + 1))
                       for i in range(batch)) for r in range(min(rounds, 4096))]
    # The subscriber's PUBACKs, precomputed: its session numbers packet ids 1, 2, ... in
    # order, and each round's are all acknowledged before the next.
    acks = []
    next_id = 1
    for _ in range(min(rounds, 65535 // batch)):
        acks.append(b"".join(encode(PubAck(next_id + i)) for i in range(batch)))
        next_id += batch
    cycle = len(acks)

    def run() -> None:
        session.next_packet_id = 1
        for r in range(rounds):
            events = publisher.receive_data(chunks[r % len(chunks)])
            for event in events:
                session.deliver(event.message, 1, False, 0.0)
                publisher.ack_publish(event.packet_id, 1)
            publisher.data_to_send()
            subscriber.data_to_send()
            subscriber.receive_data(acks[r % cycle])
            if r % cycle == cycle - 1:
                session.next_packet_id = 1  # the ids the precomputed PUBACKs name again

    rate = best_rate(rounds * batch, run, repeat)
    assert not session.inflight, "every delivery acknowledged"
    return {"messages_per_s": rate, "us_per_message": 1e6 / rate}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packets", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    packets = 5_000 if args.quick else args.packets
    repeat = 1 if args.quick else args.repeat

    results: dict[str, object] = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "packets": packets,
        "payload_bytes": 64,
        "decode_publish_qos0": bench_decode(packets, 0, repeat),
        "decode_publish_qos1": bench_decode(packets, 1, repeat),
        "encode": bench_encode(packets, repeat),
        "qos1_protocol_round": bench_qos1_round(packets, repeat),
        "trie_1000_wildcard_filters": bench_trie(1000, packets // 4, repeat),
        "index_10000_retained": bench_index(10_000, packets // 100, repeat),
    }
    for name, value in results.items():
        if isinstance(value, dict):
            figures = ", ".join(
                f"{k}={v:,.0f}" if v >= 100 else f"{k}={v:.2f}" for k, v in value.items()
            )
            print(f"{name:28} {figures}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
