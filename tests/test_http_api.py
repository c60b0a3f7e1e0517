"""The HTTP API and ``/metrics`` of one node process, over real HTTP, with real paho clients.

What it proves: each endpoint answers what the broker holds (clients, subscriptions,
retained messages), its actions act (a kick closes the real client's connection, a publish
reaches a real subscriber, a retained delete is seen by the next subscriber), bad requests
and bad tokens are refused with a JSON 4xx and change nothing, topics and client ids that
an HTTP client would rewrite in a URL path (``junk/../victim/cfg``, ``..``, ``a//b``) are
read, deleted and kicked exactly through ``?topic=`` / ``?client=`` (and refused in the path),
and the Prometheus metrics parse and move when messages flow.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from http_support import HOST, TOKEN, HttpNode, scrape, wait_for


@pytest.fixture
def node(tmp_path: Path) -> Iterator[HttpNode]:
    node = HttpNode(tmp_path)
    yield node
    node.stop()


def test_a_token_is_required_beyond_loopback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MQTTRING_HTTP_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "mqttring.node", "--mqtt", f"{HOST}:0", "--http", "0.0.0.0:0",
         "--data-dir", str(tmp_path / "d")], env=env, capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 2, done.stderr
    assert "configuration error" in done.stderr and "http_token" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("http", "token", "ok"), [
    (":8080", None, True), ("127.0.0.1:8080", None, True), ("localhost:0", None, True),
    ("[::1]:8080", None, True), ("0.0.0.0:8080", None, False), ("10.1.2.3:8080", None, False),
    ("broker.example:8080", None, False), ("[::]:8080", None, False),
    ("0.0.0.0:8080", TOKEN, True),
])
def test_http_settings(http: str, token: str | None, ok: bool) -> None:
    from mqttring.config import BrokerConfig, ConfigError

    if ok:
        config = BrokerConfig.from_mapping({"http": http}, http_token=token)
        assert (config.http, config.http_token) == (http, token)
    else:
        with pytest.raises(ConfigError, match="http_token"):
            BrokerConfig.from_mapping({"http": http}, http_token=token)


def test_http_token_must_be_long_enough() -> None:
    from mqttring.config import BrokerConfig, ConfigError

    for bad in ("short", 12345678901234567890):
        with pytest.raises(ConfigError, match="http_token"):
            BrokerConfig.from_mapping({"http": ":0", "http_token": bad})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        BrokerConfig.from_mapping({"http": "nowhere"})


def test_every_request_needs_the_token(node: HttpNode) -> None:
    for client in (node.http(token="wrong-token-wrong-token"), node.http(token=None)):
        with client:
            for path in ("/api/v1/cluster", "/metrics", "/api/v1/clients",
                         "/api/v1/nodes/h1/stats", "/static/../api/v1/cluster"):
                response = client.get(path)
                assert response.status_code == 401, (path, response.text)
                assert response.json() == {"error": "missing or wrong token"}
            response = client.post("/api/v1/publish", json={"topic": "x", "retain": True})
            assert response.status_code == 401
            assert client.delete("/api/v1/clients/x").status_code == 401
            # The dashboard's page and files hold no data: a browser loads them, then the
            # page asks for the token.
            page = client.get("/")
            assert page.status_code == 200 and "mqttring" in page.text
            assert client.get("/static/dashboard.js").status_code == 200
            assert client.post("/").status_code == 401
    with node.http() as client:
        assert client.get("/api/v1/cluster").status_code == 200
        assert client.get("/api/v1/retained").json()["retained"] == []  # nothing published
    basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    with node.http(token=None) as client:
        ok = client.get("/api/v1/cluster", headers={"Authorization": f"Basic {basic}"})
        assert ok.status_code == 200


def test_without_a_token_only_loopback_hosts_are_served(tmp_path: Path) -> None:
    node = HttpNode(tmp_path, token=None)
    try:
        with node.http() as client:
            assert client.get("/api/v1/cluster").status_code == 200
            for host in (f"localhost:{node.http_port}", "[::1]:1", "127.0.0.1", "LocalHost:1"):
                response = client.get("/api/v1/cluster", headers={"host": host})
                assert response.status_code == 200, host
            # DNS rebinding: a page of rebind.example resolved to 127.0.0.1 names its host.
            for path in ("/api/v1/cluster", "/", "/metrics"):
                response = client.get(path, headers={"host": f"rebind.example:{node.http_port}"})
                assert response.status_code == 403, path
                assert "loopback" in response.json()["error"]
            # Hosts that only start like a loopback one are not one.
            for host in ("[::1", "[::1]x", "127.0.0.1:http", "localhost:1:2"):
                response = client.get("/api/v1/cluster", headers={"host": host})
                assert response.status_code == 403, host
    finally:
        node.stop()


def test_cluster_of_one(node: HttpNode) -> None:
    with node.http() as client:
        cluster = client.get("/api/v1/cluster").json()
    assert cluster["quorum"] is True and cluster["clustered"] is False
    assert cluster["leader"] == node.node_id
    [member] = cluster["members"]
    assert member["id"] == node.node_id and member["state"] == "up"
    assert member["mqtt"] == f"{HOST}:{node.port}"
    assert member["shards"]["owner"] == cluster["num_shards"]


def test_clients_subscriptions_kick_and_publish(node: HttpNode, paho_any) -> None:
    sub = paho_any(node, "sub-1", clean_session=False)
    sub.connect(keepalive=42)
    assert sub.subscribe("t/#", 1) == [1]
    others = [paho_any(node, f"other-{i}") for i in range(3)]
    for other in others:
        other.connect()
    with node.http() as client:
        listed = client.get("/api/v1/clients").json()
        ids = [c["client_id"] for c in listed["clients"]]
        assert ids == ["other-0", "other-1", "other-2", "sub-1"]
        one = client.get("/api/v1/clients/sub-1").json()
        assert one["node"] == node.node_id and one["keepalive"] == 42
        assert one["clean_session"] is False and one["subscriptions"] == 1
        assert one["address"].startswith(f"{HOST}:") and one["connected_since"] > 0
        assert {"queued", "inflight"} <= one.keys()

        # Paging: two, then the rest after the cursor.
        first = client.get("/api/v1/clients", params={"limit": 2}).json()
        assert [c["client_id"] for c in first["clients"]] == ["other-0", "other-1"]
        rest = client.get("/api/v1/clients", params={"limit": 2, "after": first["next"]}).json()
        assert [c["client_id"] for c in rest["clients"]] == ["other-2", "sub-1"]

        subs = client.get("/api/v1/subscriptions", params={"client": "sub-1"}).json()
        assert subs["subscriptions"] == [
            {"client_id": "sub-1", "filter": "t/#", "qos": 1, "node": node.node_id}]

        # A publish through the API reaches the real subscriber.
        response = client.post("/api/v1/publish",
                               json={"topic": "t/api", "payload": "héllo", "qos": 1})
        assert response.status_code == 200, response.text
        message = sub.get()
        assert (message.topic, message.payload, message.qos) == ("t/api", "héllo".encode(), 1)
        raw = bytes(range(256))
        client.post("/api/v1/publish", json={
            "topic": "t/bin", "payload": base64.b64encode(raw).decode(), "encoding": "base64",
            "retain": True}).raise_for_status()
        assert sub.get().payload == raw

        # The retained browser shows it; deleting it is seen by the next subscriber.
        found = client.get("/api/v1/retained", params={"filter": "t/#"}).json()["retained"]
        assert [(r["topic"], r["size"], r["encoding"]) for r in found] == [
            ("t/bin", 256, "base64")]
        assert base64.b64decode(found[0]["preview"]) == raw
        assert client.delete("/api/v1/retained/t/bin").json() == {"deleted": "t/bin"}
        assert client.get("/api/v1/retained", params={"filter": "#"}).json()["retained"] == []
        late = paho_any(node, "late")
        late.connect()
        late.subscribe("t/#", 0)
        assert late.drain(0.3) == []

        # Kick: the real client's connection is closed, and it is gone from the listing.
        assert client.delete("/api/v1/clients/sub-1").json() == {
            "kicked": "sub-1", "nodes": [node.node_id]}
        assert sub.disconnected.wait(10), "kicked client still connected"
        wait_for(lambda: client.get("/api/v1/clients/sub-1").status_code == 404, 10,
                 "the kicked client to leave the listing")
        # Its persistent session stays (a kick is not a clean-session reset).
        subs = client.get("/api/v1/subscriptions").json()["subscriptions"]
        assert ("sub-1", "t/#") in [(s["client_id"], s["filter"]) for s in subs]


def test_bad_requests_change_nothing(node: HttpNode, paho_any) -> None:
    with node.http() as client:
        before = scrape(client)
        bad_publishes = [
            (b"{not json", 400), (b"[1, 2]", 400), (b'{"topic": "a/+"}', 400),
            (b'{"topic": ""}', 400), (b'{"topic": "a", "qos": 3}', 400),
            (b'{"topic": "a", "qos": "1"}', 400), (b'{"topic": "a", "retain": 1}', 400),
            (b'{"topic": "a", "payload": "***", "encoding": "base64"}', 400),
            (b'{"topic": "a", "encoding": "rot13"}', 400), (b'{"topic": "a", "x": 1}', 400),
            (b'{"topic": "$SYS/broker/version", "retain": true}', 400),
            (b'{"topic": "a", "payload": 5}', 400),
            # Nesting past the JSON parser's recursion limit (a 500 and a traceback before).
            (b"[" * 100_000 + b"]" * 100_000, 400),
        ]
        for body, status in bad_publishes:
            response = client.post("/api/v1/publish", content=body,
                                   headers={"content-type": "application/json"})
            assert response.status_code == status, (body, response.text)
            assert set(response.json()) == {"error"}, body
        huge = b'{"topic": "a", "retain": true, "payload": "' + b"x" * 2_000_000 + b'"}'
        response = client.post("/api/v1/publish", content=huge,
                               headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text
        # A form or text/plain post is what a page from elsewhere can send without asking.
        for media_type in ("text/plain", "application/x-www-form-urlencoded", None):
            response = client.post("/api/v1/publish", content=b'{"topic": "a"}',
                                   headers={"content-type": media_type} if media_type else {})
            assert response.status_code == 415, (media_type, response.text)
        for method, path, status in [
            ("GET", "/api/v1/clients/nobody", 404), ("DELETE", "/api/v1/clients/nobody", 404),
            ("GET", "/api/v1/clients?limit=0", 400), ("GET", "/api/v1/clients?limit=x", 400),
            ("GET", "/api/v1/retained?filter=a/%23/b", 400),
            ("GET", "/api/v1/subscriptions?after=%%%", 400),
            ("DELETE", "/api/v1/retained/a/%2B", 400),
            ("DELETE", "/api/v1/retained?topic=a/%2B", 400),
            ("GET", "/api/v1/retained?topic=a/%23", 400),
            ("DELETE", "/api/v1/retained?topic=", 400),
            ("DELETE", "/api/v1/retained?topic=%24SYS/x", 400),
            ("DELETE", "/api/v1/retained", 400),  # no topic: never "all of them"
            ("GET", "/api/v1/retained?topic=no/such", 404),
            ("DELETE", "/api/v1/clients", 400), ("DELETE", "/api/v1/clients?client=", 400),
            ("GET", "/api/v1/clients?client=nobody", 404),
            ("GET", "/api/v1/nodes/elsewhere/stats", 404),
            ("GET", "/api/v1/nope", 404), ("PUT", "/api/v1/publish", 405),
        ]:
            response = client.request(method, path)
            assert response.status_code == status, (method, path, response.text)
            assert set(response.json()) == {"error"}, path
        assert client.get("/api/v1/retained").json()["retained"] == []
        after = scrape(client)
    for key in ("mqttring_messages_received_total", "mqttring_messages_sent_total"):
        assert after[(key, ())] == before[(key, ())], key


def test_metrics_move_with_traffic(node: HttpNode, paho_any) -> None:
    sub = paho_any(node, "m-sub")
    sub.connect()
    sub.subscribe("m/#", 1)
    pub = paho_any(node, "m-pub")
    pub.connect()
    with node.http() as client:
        before = scrape(client)
        assert before[("mqttring_clients_connected", ())] == 2
        assert before[("mqttring_cluster_quorum", ())] == 1
        assert before[("mqttring_up", ())] == 1
        for i in range(5):
            pub.publish(f"m/{i}", b"x", qos=1)
        pub.publish("m/retained", b"r", qos=0, retain=True)
        sub.collect(6)

        def moved() -> dict | None:
            now = scrape(client)
            return now if now[("mqttring_messages_sent_total", ())] >= \
                before[("mqttring_messages_sent_total", ())] + 6 else None

        after = wait_for(moved, 10, "messages_sent to count the deliveries")
    q1 = ("mqttring_publishes_received_by_qos_total", (("qos", "1"),))
    q0 = ("mqttring_publishes_received_by_qos_total", (("qos", "0"),))
    assert after[q1] - before[q1] == 5 and after[q0] - before[q0] == 1
    assert after[("mqttring_messages_received_total", ())] - \
        before[("mqttring_messages_received_total", ())] == 6
    assert after[("mqttring_retained_messages", ())] == 1
    assert after[("mqttring_subscriptions", ())] == 1
    received = ("mqttring_bytes_received_total", ())
    assert after[received] > before[received]
    assert ("mqttring_store_commits_total", ()) in after  # lazily written: may still be 0
    assert after[("mqttring_store_used_bytes", ())] > 0
    assert ("process_resident_memory_bytes", ()) in after


def test_a_kicked_mqtt5_client_is_told_administrative_action(node: HttpNode) -> None:
    """MQTT 5: a kick is DISCONNECT 0x98 "administrative action" before the close."""
    from mqtt5_support import Paho5

    client = Paho5(node.host, node.port, "v5-kicked")
    try:
        client.connect()
        with node.http() as http:
            assert http.delete("/api/v1/clients/v5-kicked").json()["kicked"] == "v5-kicked"
        assert client.disconnects.get(timeout=10) == 0x98
    finally:
        client.client.loop_stop()


def test_share_metrics_move(node: HttpNode, paho_any) -> None:
    """``mqttring_shared_groups`` counts the shares with members here; placements count."""
    member = paho_any(node, "sh-member")
    member.connect()
    pub = paho_any(node, "sh-pub")
    pub.connect()
    with node.http() as client:
        before = scrape(client)
        member.subscribe("$share/g/sh/#", 1)
        for i in range(3):
            pub.publish(f"sh/{i}", b"x", qos=1)
        member.collect(3)
        after = scrape(client)
    placed = ("mqttring_shared_placed_total", ())
    groups = ("mqttring_shared_groups", ())
    assert after[groups] == before[groups] + 1
    assert after[placed] == before[placed] + 3
    for key in ("mqttring_shared_declined_total", "mqttring_shared_redispatched_total",
                "mqttring_shared_untracked_total"):
        assert (key, ()) in after


def test_a_request_that_stops_coming_is_closed_after_http_read_timeout(tmp_path: Path) -> None:
    """Half a request, then silence (a slow-body client): the listener closes the connection
    after ``http_read_timeout`` instead of holding it, and its task, for ever."""
    import socket
    import time

    config = tmp_path / "node.toml"
    config.write_text("http_read_timeout = 1.0\n")
    node = HttpNode(tmp_path, extra=("--config", str(config)))
    try:
        with socket.create_connection((HOST, node.http_port), timeout=10) as sock:
            sock.sendall(b"POST /api/v1/publish HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"topic\":")
            started = time.monotonic()
            sock.settimeout(10)
            data = b"".join(iter(lambda: sock.recv(4096), b""))  # until the server closes
            waited = time.monotonic() - started
        assert 0.8 <= waited < 5, (waited, data)
        with node.http() as http:  # the node serves on
            assert http.get("/api/v1/cluster").status_code == 200
    finally:
        node.stop()


@pytest.fixture
def embedded_http_port() -> Iterator[int]:
    """The HTTP port of an in-process node (no token: loopback only), for the tests that
    read the node's log records (``caplog``) or time its sockets."""
    from mqttring import BrokerConfig, MqttRingBroker

    broker = MqttRingBroker(BrokerConfig(node_id="hx", mqtt=f"{HOST}:0", http=f"{HOST}:0",
                                         data_dir=None, sys_interval=0))
    broker.start(timeout=30)
    assert broker.http_port is not None
    yield broker.http_port
    broker.stop(timeout=30)


def _until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    return b"".join(iter(lambda: sock.recv(65536), b""))


def test_a_client_that_goes_away_mid_request_is_no_error(
        embedded_http_port: int, caplog: pytest.LogCaptureFixture) -> None:
    """A publish whose body stops short of its Content-Length, then the client closes; and
    a publish whose chunked body Hypercorn refuses (it answers 400 itself).  Nobody is left
    to answer: the log says so at debug, with no ERROR and no traceback."""
    caplog.set_level(logging.DEBUG, logger="mqttring.http")
    head = (b"POST /api/v1/publish HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n")
    with socket.create_connection((HOST, embedded_http_port), timeout=10) as sock:
        sock.sendall(head + b'Content-Length: 100\r\n\r\n{"topic":"a"}')
    with socket.create_connection((HOST, embedded_http_port), timeout=10) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                     b"zz\r\nabc\r\n0\r\n\r\n")
        assert _until_closed(sock).startswith(b"HTTP/1.1 400")

    def gone() -> int:
        return sum("went away" in r.getMessage() for r in caplog.records)

    wait_for(lambda: gone() >= 2, 10, "both requests to end")
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


@pytest.mark.parametrize(("path", "media_type", "text"), [
    ("/", b"text/html", b"mqttring"),
    ("/static/dashboard.js", b"text/javascript", b""),
    ("/static/vendor/uPlot.min.css", b"text/css", b""),
])
def test_the_dashboard_closes_at_once_when_asked_to(
        embedded_http_port: int, path: str, media_type: bytes, text: bytes) -> None:
    """``Connection: close`` on the dashboard's page and files: the answer, then the socket
    closed at once, as on every API route (not after ``http_read_timeout``, 10 s)."""
    with socket.create_connection((HOST, embedded_http_port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     "Connection: close\r\n\r\n".encode())
        began = time.monotonic()
        answer = _until_closed(sock)
        waited = time.monotonic() - began
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"content-type: " + media_type in head.lower() and text in body
    assert waited < 3, waited


def test_only_the_shipped_dashboard_files_are_served(embedded_http_port: int) -> None:
    for path in ("/static/nope.js", "/static/../api/v1/cluster", "/static/%2e%2e/http/app.py",
                 "/static/vendor"):
        with socket.create_connection((HOST, embedded_http_port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Connection: close\r\n\r\n".encode())
            answer = _until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 404"), (path, answer[:200])


#: Topics an HTTP client cannot carry in a URL path: "." and ".." levels (removed before
#: sending: "junk/../victim/cfg" goes out as "victim/cfg"), empty levels, and text that
#: looks like escapes, query or fragment, spaces, unicode.  All legal MQTT topic names.
ODD_TOPICS = [
    "junk/../victim/cfg", "a/./b", "..", ".", "../up", "a//b", "/lead", "trail/", "/",
    "pct/%2F/%2e%2e/%/x", "q?x=1&y=2;z", "frag%23not", "sp ace/plus",
    "ünï/€/日本語", "a/b/..", "$odd/dollar",
]


def _raw(node: HttpNode, method: str, target: str) -> tuple[int, dict]:
    """One request sent byte for byte as written (no client rewrites its path), its JSON."""
    with socket.create_connection((HOST, node.http_port), timeout=10) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {HOST}\r\n"
                     f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
        answer = _until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def _retained_topics(client) -> set[str]:
    page = client.get("/api/v1/retained", params={"filter": "#", "limit": 1000}).json()
    dollar = client.get("/api/v1/retained", params={"filter": "$odd/#"}).json()
    return {r["topic"] for r in page["retained"] + dollar["retained"]}


def test_odd_retained_topics_are_read_and_deleted_exactly(node: HttpNode, paho_any) -> None:
    """``?topic=`` names any topic exactly: each odd one is read back and deleted alone,
    and deleting ``junk/../victim/cfg`` leaves ``victim/cfg`` (what the dashboard's delete
    button of the first did through the path form) for the next subscriber."""
    topics = ["victim/cfg", "a/b", "up", "b", *ODD_TOPICS]
    pub = paho_any(node, "odd-pub")
    pub.connect()
    with node.http() as client:
        for topic in topics:
            if topic.isascii():  # one way in through MQTT, the others through the API
                pub.publish(topic, f"payload of {topic}".encode(), qos=1, retain=True)
            else:
                client.post("/api/v1/publish", json={
                    "topic": topic, "payload": f"payload of {topic}", "qos": 1,
                    "retain": True}).raise_for_status()
        wait_for(lambda: _retained_topics(client) == set(topics), 10, "every retained topic")

        for topic in topics:
            # httpx encodes the parameter itself; the second form is encodeURIComponent's.
            for answer in (client.get("/api/v1/retained", params={"topic": topic}),
                           client.get(f"/api/v1/retained?topic={quote(topic, safe='')}")):
                assert answer.status_code == 200, (topic, answer.text)
                row = answer.json()
                assert (row["topic"], row["payload"], row["encoding"]) == (
                    topic, f"payload of {topic}", "utf8"), topic
                assert row["size"] == len(f"payload of {topic}".encode())

        answer = client.delete(f"/api/v1/retained?topic={quote('junk/../victim/cfg', safe='')}")
        assert answer.json() == {"deleted": "junk/../victim/cfg"}
        assert client.get("/api/v1/retained", params={"topic": "junk/../victim/cfg"}
                          ).status_code == 404
        kept = client.get("/api/v1/retained", params={"topic": "victim/cfg"})
        assert kept.status_code == 200 and kept.json()["payload"] == "payload of victim/cfg"
        late = paho_any(node, "odd-late")
        late.connect()
        late.subscribe("victim/cfg", 1)
        message = late.get()
        assert (message.topic, message.payload) == ("victim/cfg", b"payload of victim/cfg")

        left = set(topics) - {"junk/../victim/cfg"}
        for topic in ODD_TOPICS[1:]:
            answer = client.delete("/api/v1/retained", params={"topic": topic})
            assert answer.json() == {"deleted": topic}, (topic, answer.text)
            left.discard(topic)
            assert _retained_topics(client) == left, topic  # that one, no other
        assert left == {"victim/cfg", "a/b", "up", "b"}


def test_the_path_form_refuses_what_a_client_may_have_rewritten(node: HttpNode,
                                                                paho_any) -> None:
    """The old form (name in the path) still works for a plain name, and is refused with a
    400 naming ``?topic=`` / ``?client=`` when the name has ".", ".." or empty levels
    (sent here byte for byte, as a client that does not rewrite paths would)."""
    victim = paho_any(node, "victim")
    victim.connect()
    with node.http() as client:
        for topic in ("victim/cfg", "junk/../victim/cfg", "a/./b", "a//b", "trail/",
                      "plain/topic"):
            client.post("/api/v1/publish", json={"topic": topic, "payload": "x",
                                                 "retain": True}).raise_for_status()
        for target in ("/api/v1/retained/junk/../victim/cfg", "/api/v1/retained/a/./b",
                       "/api/v1/retained/a//b", "/api/v1/retained/trail/",
                       "/api/v1/retained/junk/%2e%2e/victim/cfg",
                       "/api/v1/retained/junk%2F..%2Fvictim%2Fcfg"):
            status, body = _raw(node, "DELETE", target)
            assert status == 400, (target, body)
            assert "?topic=" in body["error"], body
        for target in ("/api/v1/clients/junk/../victim", "/api/v1/clients/junk%2F..%2Fvictim",
                       "/api/v1/clients/..", "/api/v1/clients/."):
            for method in ("GET", "DELETE"):
                status, body = _raw(node, method, target)
                assert status == 400, (method, target, body)
                assert "?client=" in body["error"], body
        assert _retained_topics(client) == {"victim/cfg", "junk/../victim/cfg", "a/./b",
                                            "a//b", "trail/", "plain/topic"}
        assert not victim.disconnected.is_set()
        # A plain name still works in the path.
        assert client.delete("/api/v1/retained/plain/topic").json() == {
            "deleted": "plain/topic"}
        assert "plain/topic" not in _retained_topics(client)
        assert client.get("/api/v1/clients/victim").json()["client_id"] == "victim"


def test_the_query_parameter_is_taken_exactly(node: HttpNode) -> None:
    """Percent-decoded bytes that are not UTF-8 are refused, not turned into U+FFFD (another
    topic); a parameter given twice, or next to a listing's parameters, is refused."""
    with node.http() as client:
        client.post("/api/v1/publish", json={"topic": "x/\ufffd", "payload": "x",
                                             "retain": True}).raise_for_status()
        assert client.get("/api/v1/retained?topic=x/%EF%BF%BD").status_code == 200
        for target in ("/api/v1/retained?topic=x/%FF", "/api/v1/retained?topic=a&topic=b",
                       "/api/v1/retained?topic=a&filter=%23", "/api/v1/retained?topic=a&limit=5",
                       "/api/v1/clients?client=%FF", "/api/v1/clients?client=a&after=b"):
            for method in ("GET", "DELETE"):
                response = client.request(method, target)
                assert response.status_code == 400, (method, target, response.text)
                assert set(response.json()) == {"error"}
        assert _retained_topics(client) == {"x/\ufffd"}


def test_odd_client_ids_are_shown_and_kicked_exactly(node: HttpNode, paho_any) -> None:
    """``?client=`` names any client id exactly; a kick of ``junk/../victim`` (or ``..``)
    closes that connection and no other."""
    ids = ["victim", "junk/../victim", "..", ".", "a//b", "sp ace/ü", "100%2F"]
    clients = {cid: paho_any(node, cid) for cid in ids}
    for paho in clients.values():
        paho.connect()
    with node.http() as http:
        for cid in ids:
            for answer in (http.get("/api/v1/clients", params={"client": cid}),
                           http.get(f"/api/v1/clients?client={quote(cid, safe='')}")):
                assert answer.status_code == 200, (cid, answer.text)
                assert answer.json()["client_id"] == cid
        for cid in ("junk/../victim", "..", ".", "a//b", "sp ace/ü", "100%2F"):
            answer = http.delete(f"/api/v1/clients?client={quote(cid, safe='')}")
            assert answer.json() == {"kicked": cid, "nodes": [node.node_id]}, answer.text
            assert clients[cid].disconnected.wait(10), cid
        wait_for(lambda: [c["client_id"] for c in http.get("/api/v1/clients").json()["clients"]]
                 == ["victim"], 10, "only the victim to stay connected")
        assert not clients["victim"].disconnected.is_set()
