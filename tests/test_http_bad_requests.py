"""Requests a fuzz probe (2026-11-29) sent the HTTP API, over raw sockets to a node process.

* A ``Connection: close`` request followed by bytes beyond its ``Content-Length``: Hypercorn
  (0.18) answered those bytes with a bare 400 while the app was answering the request, and
  the two writes met on the socket (``trio.BusyResourceError``, logged as "Error in ASGI
  Framework" with a traceback; the client got nothing, or the bare 400 instead of the
  app's JSON).  The request is answered, in JSON, and the extra bytes are dropped.
* Leniencies: a non-ASCII digit in ``limit``, a ``filter`` that is not UTF-8, a JSON body
  with a key given twice, a ``utf8`` payload with a lone surrogate: each refused with a
  JSON 400 now, as their neighbours were.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from http_support import HOST, TOKEN, HttpNode

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpNode]:
    node = HttpNode(Path(tmp_path_factory.mktemp("http-bad")))
    try:
        yield node
    finally:
        node.stop()
        log = node.log.read_text()
        assert "Traceback" not in log and "Error in ASGI" not in log, log[-4000:]


def _exchange(node: HttpNode, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` on a fresh connection, read until the node closes it: (status,
    headers, body) of the first answer; fails if none comes."""
    with socket.create_connection((HOST, node.http_port), timeout=10) as sock:
        sock.sendall(raw)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    assert data, "no answer at all"
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", len(body)))
    return int(status_line.split(" ", 2)[1]), headers, body[:length]


def _request(method: str, target: str, body: bytes = b"", *, declared: int | None = None,
             extra: bytes = b"") -> bytes:
    length = len(body) if declared is None else declared
    return (f"{method} {target} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body + extra


def _json_error(node: HttpNode, raw: bytes, status: int = 400) -> str:
    got, headers, body = _exchange(node, raw)
    assert got == status, (got, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), (headers, body)
    message = json.loads(body)["error"]
    assert isinstance(message, str) and message
    return message


@pytest.mark.parametrize("size", [70_000, 20_000, 1000, 10])
def test_bytes_after_the_declared_body_get_the_apps_json_answer(
        node: HttpNode, size: int) -> None:
    """The body is cut 4 bytes short by its ``Content-Length`` (those are sent after it):
    the app answers what it was given (not JSON: 400), and nothing reaches the log."""
    body = b'{"topic":"' + b"a" * size + b'","payload":"x"}'
    message = _json_error(node, _request("POST", "/api/v1/publish", body,
                                         declared=len(body) - 4))
    assert "not JSON" in message


def test_a_whole_request_followed_by_junk_is_still_answered(node: HttpNode) -> None:
    """A valid publish and then bytes that are no request, on a connection the client said
    it closes: the publish is done and answered."""
    body = json.dumps({"topic": "probe/junk", "payload": "x"}).encode()
    status, _, answer = _exchange(node, _request("POST", "/api/v1/publish", body,
                                                 extra=b"\x00junk\r\n\r\n"))
    assert status == 200, answer
    assert json.loads(answer)["published"] == "probe/junk"


@pytest.mark.parametrize("limit", ["%D9%A3", "%EF%BC%93", "+3", "3_0", "%203", "9" * 5000])
def test_limit_takes_ascii_digits_only(node: HttpNode, limit: str) -> None:
    """An Arabic-Indic and a fullwidth three were read as 3, as Python's int()
    reads them; "+3", "3_0" and " 3" likewise; 5000 digits are out of range, not a 500."""
    message = _json_error(node, _request("GET", f"/api/v1/clients?limit={limit}"))
    assert "limit" in message


def test_a_filter_that_is_not_utf8_is_refused(node: HttpNode) -> None:
    """As ``client=`` and ``topic=`` were: not a U+FFFD stand-in for what was sent."""
    message = _json_error(node, _request("GET", "/api/v1/retained?filter=%ED%A0%80"))
    assert "filter" in message and "UTF-8" in message


def test_a_json_key_given_twice_is_refused(node: HttpNode) -> None:
    body = b'{"topic":"a","payload":"x","topic":"b"}'
    message = _json_error(node, _request("POST", "/api/v1/publish", body))
    assert "topic" in message and "twice" in message


def test_a_utf8_payload_with_a_lone_surrogate_is_refused(node: HttpNode) -> None:
    body = b'{"topic":"a","payload":"\\udc80"}'
    message = _json_error(node, _request("POST", "/api/v1/publish", body))
    assert "surrogate" in message or "UTF-8" in message


@pytest.mark.parametrize("raw", [
    b"\x00junk\r\n\r\n",  # no request line at all
    b"GET /api/v1/cluster HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",  # a space in a name
])
def test_a_malformed_request_is_refused_in_json(node: HttpNode, raw: bytes) -> None:
    """Hypercorn refuses these before the app sees them; its 400 had an empty body."""
    assert "malformed HTTP request" in _json_error(node, raw)
