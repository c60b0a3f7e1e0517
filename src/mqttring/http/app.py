"""The ASGI application: routes of the JSON API, ``/metrics`` and the dashboard's files.

Every answer is JSON (``/metrics`` aside); every refusal is ``{"error": "..."}`` with a 4xx
status and changes nothing: a malformed body, an unknown client, a body over the bound, a
missing or wrong token.  Authentication is one ASGI middleware in front of everything, so
no route can forget it; the token is compared in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import mimetypes
import re
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mqttring.config import is_loopback
from mqttring.http.prometheus import node_registry
from mqttring.http.queries import ClusterQueries, NotFound, Unavailable, decode_cursor
from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.message import Message
from mqttring.protocol.topics import validate_topic_filter, validate_topic_name

if TYPE_CHECKING:
    from mqttring.embedded import MqttRingBroker

log = logging.getLogger("mqttring.http")

#: Longest page a listing returns.
MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
#: Room a JSON publish body takes beyond the payload (base64 grows it by a third).
_BODY_SLACK = 4096


class BadRequest(ValueError):
    """The request is malformed (HTTP 400); the message says what to fix."""


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


#: Open without a token: the dashboard's page and its static files (shipped in the
#: package, no data in them), so a browser can load the page, which then asks for the token.
PUBLIC_PATHS = ("/", "/dashboard")
PUBLIC_PREFIX = "/static/"


class TokenAuth:
    """Refuse (401) every request without ``Authorization: Bearer <token>`` or HTTP basic
    with the token as password (any user name), except GETs of the dashboard's static files.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan
            return
        if self.token is None:
            # No token: the listener is on loopback (BrokerConfig refuses a token-less
            # listener beyond it).  A web page
            # the operator visits could still reach it through a name of its own that
            # resolves to 127.0.0.1 (DNS rebinding); such a request names that host.
            if not _loopback_host(scope):
                response = error(403, "without http_token only a loopback Host is served")
                await response(scope, receive, send)
                return
        elif not (self._public(scope) or self._authorized(scope)):
            response = error(401, "missing or wrong token",
                             {"WWW-Authenticate": 'Basic realm="mqttring", charset="UTF-8"'})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _public(scope: Scope) -> bool:
        path = scope["path"]
        return scope.get("method") in ("GET", "HEAD") and (
            path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX))

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, credentials = header.partition(b" ")
        given = b""
        if scheme.lower() == b"bearer":
            given = credentials.strip()
        elif scheme.lower() == b"basic":
            try:
                given = base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
        return hmac.compare_digest(given, self.token)


def _loopback_host(scope: Scope) -> bool:
    host = b""
    for name, value in scope["headers"]:
        if name == b"host":
            host = value
            break
    text = host.decode("latin-1")
    if text.startswith("["):
        name, closed, port = text[1:].partition("]")
        if not closed or (port and not _PORT.fullmatch(port)):
            return False  # "[::1" or "[::1]x" is no host at all
    else:
        name, colon, port = text.rpartition(":") if ":" in text else (text, "", "")
        if colon and not _PORT.fullmatch(colon + port):
            return False
    return is_loopback(name)


_PORT = re.compile(r":[0-9]{1,5}")


def _limit(request: Request) -> int:
    """``limit``: ASCII digits only.  Python's ``int`` also reads other scripts' digits
    ("\u0663" is 3), a sign, ``_`` and spaces around, none of which a client means."""
    raw = request.query_params.get("limit", str(DEFAULT_LIMIT))
    if not (raw.isascii() and raw.isdigit()):
        raise BadRequest(f"limit must be an integer (ASCII digits), got {raw[:20]!r}")
    # (Not int() of any length: over 4300 digits it raises a ValueError of its own.)
    value = int(raw) if len(raw) <= 9 else MAX_LIMIT + 1
    if not 1 <= value <= MAX_LIMIT:
        raise BadRequest(f"limit must be in 1..{MAX_LIMIT}")
    return value


def _exact_param(request: Request, name: str) -> str | None:
    """The query parameter ``name`` exactly as the client percent-encoded it, None when
    absent: read from the raw query string, so a value that is not UTF-8 once decoded is
    refused (Starlette's own parsing would turn it into U+FFFD, another name) and a
    parameter given twice is refused rather than one of the two picked.  ``+`` stands for
    a space, as in any form-encoded query: a topic name holds no ``+`` (a wildcard), and a
    client id's own ``+`` is sent as ``%2B`` (``encodeURIComponent`` and curl's
    ``--data-urlencode`` do so)."""
    wanted = name.encode()
    found: list[bytes] = []
    for part in request.scope.get("query_string", b"").split(b"&"):
        key, _, value = part.partition(b"=")
        if unquote_to_bytes(key.replace(b"+", b" ")) == wanted:
            found.append(unquote_to_bytes(value.replace(b"+", b" ")))
    if not found:
        return None
    if len(found) > 1:
        raise BadRequest(f"{name} given more than once")
    try:
        return found[0].decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"{name} is not UTF-8 once percent-decoded") from None


def _only(request: Request, name: str, *others: str) -> None:
    """Refuse ``others`` next to ``name`` (a request for one thing, not a listing)."""
    given = sorted(set(others) & set(request.query_params))
    if given:
        raise BadRequest(f"{name} names one item and does not go with {', '.join(given)}")


#: Why a name cannot come in the URL's path: a browser, fetch(), curl and most HTTP
#: clients remove the path's "." and ".." segments before sending (a/../b arrives as b),
#: and proxies may merge "//" or drop a trailing "/".  So a name whose "/"-separated parts
#: include ".", ".." or an empty one may not be the one the client was given; the query
#: parameter carries any name exactly.
_UNSAFE_PATH_LEVELS = frozenset({"", ".", ".."})


def _from_path(request: Request, key: str, base: str, param: str, what: str) -> str:
    """A topic or client id in the URL path (the old form), refused when the path could
    have been rewritten on the way: see ``_UNSAFE_PATH_LEVELS``."""
    value: str = request.path_params[key]
    if _UNSAFE_PATH_LEVELS.intersection(value.split("/")):
        raise BadRequest(
            f"a {what} with '.', '..' or empty levels cannot travel in the URL path (HTTP "
            f"clients rewrite such paths, so {value!r} may not be the {what} you meant): "
            f"use {request.method} {base}?{param}=<percent-encoded {what}>")
    return value


async def _json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object, read up to ``max_bytes`` (413 beyond, before parsing).

    Only ``Content-Type: application/json``: a browser must then ask (CORS preflight, which
    this API never grants) before a page from elsewhere could post here."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise HTTPException(415, "the body must be JSON (Content-Type: application/json)")
    # The rest of a refused body is never read, so the connection cannot carry another
    # request: say so, and the client opens a new one.
    too_large = HTTPException(413, f"body larger than {max_bytes} bytes",
                              headers={"Connection": "close"})
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        data = json.loads(body, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting
        if isinstance(exc, BadRequest):
            raise
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: ``json`` keeps the last of a key given
    twice, where another reader may keep the first (a proxy that checked "topic" and this
    node could read two topics from one body)."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise BadRequest(f"body gives the key {twice[:100]!r} twice")
    return data


def parse_publish(data: dict[str, Any], max_payload: int) -> Message:
    """A publish request to a ``Message``, validated as a client's PUBLISH would be."""
    unknown = set(data) - {"topic", "payload", "qos", "retain", "encoding"}
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
    topic, payload = data.get("topic"), data.get("payload", "")
    qos, retain = data.get("qos", 0), data.get("retain", False)
    encoding = data.get("encoding", "utf8")
    if not isinstance(topic, str):
        raise BadRequest("topic must be a string")
    try:
        validate_topic_name(topic)
    except InvalidTopic as exc:
        raise BadRequest(str(exc)) from None
    if topic.startswith("$SYS"):
        raise BadRequest("$SYS topics are the broker's own")
    if type(qos) is not int or qos not in (0, 1, 2):
        raise BadRequest("qos must be 0, 1 or 2")
    if type(retain) is not bool:
        raise BadRequest("retain must be true or false")
    if not isinstance(payload, str):
        raise BadRequest("payload must be a string (see encoding)")
    if encoding == "utf8":
        try:
            raw = payload.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\udc80"): no UTF-8 for it
            raise BadRequest("payload holds a lone surrogate, which UTF-8 cannot encode "
                             "(send other bytes with encoding base64)") from None
    elif encoding == "base64":
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("payload is not valid base64") from None
    else:
        raise BadRequest("encoding must be 'utf8' or 'base64'")
    if len(raw) > max_payload:
        raise BadRequest(f"payload larger than {max_payload} bytes (limits.max_packet_size)")
    return Message(topic, raw, qos, retain)


class DashboardFiles:
    """The dashboard's page and static files (about 70 kB, shipped in the package), read
    once in a worker thread and answered from memory, like any API response.

    Not Starlette's ``FileResponse`` (nor ``StaticFiles``, built on it): under an ASGI 2.x
    server such as Hypercorn it sends the file in one task while a second one waits for
    ``http.disconnect`` and cancels the first when it comes.  Hypercorn delivers that
    message as the response ends, while the first task is still closing a
    ``Connection: close`` connection, so the close was cancelled and the socket stayed
    open until ``http_read_timeout`` (10 s), where every API route closed at once.
    """

    def __init__(self, root: Traversable) -> None:
        self._root = root
        self._files: dict[str, bytes] | None = None

    def _load(self) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        pending = [(self._root, "")] if self._root.is_dir() else []
        while pending:  # bounded by the package's few directories
            directory, prefix = pending.pop()
            for entry in directory.iterdir():
                if entry.is_dir():
                    pending.append((entry, f"{prefix}{entry.name}/"))
                elif entry.is_file():
                    files[f"{prefix}{entry.name}"] = entry.read_bytes()
        return files

    async def response(self, name: str) -> Response:
        """``name`` (a path under ``static/``) as a response; 404 for anything else, so no
        path (``..`` included) reaches beyond the shipped files."""
        if self._files is None:
            self._files = await trio.to_thread.run_sync(self._load)
        body = self._files.get(name)
        if body is None:
            return error(404, f"no dashboard file {name!r}")
        media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return Response(body, media_type=media_type)


def build_app(broker: MqttRingBroker) -> ASGIApp:
    queries = ClusterQueries(broker)
    registry = node_registry(broker, queries)
    max_payload = broker.config.limits.max_packet_size
    max_body = max_payload * 4 // 3 + _BODY_SLACK
    dashboard = DashboardFiles(resources.files("mqttring.http") / "static")

    async def cluster(request: Request) -> Response:
        return JSONResponse(queries.cluster())

    async def node_stats(request: Request) -> Response:
        return JSONResponse(await queries.node_stats(request.path_params["node"]))

    async def one_client(request: Request, client_id: str) -> Response:
        if not client_id:
            raise BadRequest("the client id is empty")
        if request.method == "DELETE":
            return JSONResponse(await queries.kick(client_id))
        return JSONResponse(await queries.client(client_id))

    async def clients(request: Request) -> Response:
        client_id = _exact_param(request, "client")
        if client_id is not None:  # one client, named exactly: GET (show) or DELETE (kick)
            _only(request, "client", "limit", "after")
            return await one_client(request, client_id)
        if request.method == "DELETE":
            raise BadRequest("name the client to kick: DELETE /api/v1/clients?client="
                             "<percent-encoded client id>")
        after = request.query_params.get("after", "")
        return JSONResponse(await queries.clients(after, _limit(request)))

    async def client(request: Request) -> Response:
        """The old form, the client id in the path; see ``_from_path``."""
        return await one_client(
            request, _from_path(request, "client_id", "/api/v1/clients", "client", "client id"))

    async def subscriptions(request: Request) -> Response:
        cursor = request.query_params.get("after")
        try:
            after = decode_cursor(cursor) if cursor else ("", "")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return JSONResponse(await queries.subscriptions(
            request.query_params.get("client"), after, _limit(request)))

    async def one_retained(request: Request, topic: str) -> Response:
        try:
            validate_topic_name(topic)
        except InvalidTopic as exc:
            raise BadRequest(str(exc)) from None
        if request.method != "DELETE":
            return JSONResponse(await queries.retained_message(topic))
        if topic.startswith("$SYS"):
            raise BadRequest("$SYS topics are the broker's own")
        # An empty retained message deletes the topic's retained message [MQTT-3.3.1-10],
        # on every replica of its shard: the router does what it does for a client.
        await queries.publish(Message(topic, b"", 0, True))
        log.info("retained message of %r deleted through the HTTP API", topic)
        return JSONResponse({"deleted": topic})

    async def retained(request: Request) -> Response:
        topic = _exact_param(request, "topic")
        if topic is not None:  # one topic, named exactly: GET (read) or DELETE
            _only(request, "topic", "filter", "limit", "after")
            return await one_retained(request, topic)
        if request.method == "DELETE":
            raise BadRequest("name the topic to delete: DELETE /api/v1/retained?topic="
                             "<percent-encoded topic>")
        topic_filter = _exact_param(request, "filter")  # not UTF-8: refused, as topic=
        if topic_filter is None:
            topic_filter = "#"
        try:
            validate_topic_filter(topic_filter)
        except InvalidTopic as exc:
            raise BadRequest(str(exc)) from None
        return JSONResponse(await queries.retained(
            topic_filter, request.query_params.get("after", ""), _limit(request)))

    async def delete_retained(request: Request) -> Response:
        """The old form, the topic in the path; see ``_from_path``."""
        return await one_retained(
            request, _from_path(request, "topic", "/api/v1/retained", "topic", "topic"))

    async def publish(request: Request) -> Response:
        message = parse_publish(await _json_body(request, max_body), max_payload)
        await queries.publish(message)
        return JSONResponse({"published": message.topic, "qos": message.qos,
                             "retain": message.retain, "size": len(message.payload)})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def index(request: Request) -> Response:
        return await dashboard.response("index.html")

    async def static_file(request: Request) -> Response:
        return await dashboard.response(request.path_params["name"])

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error(exc.status_code, exc.detail, exc.headers)

    async def on_bad_request(request: Request, exc: Exception) -> Response:
        return error(400, str(exc))

    async def on_not_found(request: Request, exc: Exception) -> Response:
        return error(404, str(exc))

    async def on_unavailable(request: Request, exc: Exception) -> Response:
        return error(503, str(exc))

    async def on_client_gone(request: Request, exc: Exception) -> None:
        # The client closed before its body ended (or sent a chunked body Hypercorn
        # refused, answering 400 itself): nobody is left to answer, and nothing happened.
        # Unhandled, it was an ERROR "Error in ASGI Framework" with a traceback.
        log.debug("HTTP %s %s: the client went away before its request ended",
                  request.method, request.url.path)

    routes = [
        Route("/", index),
        Route("/dashboard", lambda r: RedirectResponse("/")),
        Route("/metrics", metrics),
        Route("/api/v1/cluster", cluster),
        Route("/api/v1/nodes/{node}/stats", node_stats),
        Route("/api/v1/clients", clients, methods=["GET", "DELETE"]),
        Route("/api/v1/clients/{client_id:path}", client, methods=["GET", "DELETE"]),
        Route("/api/v1/subscriptions", subscriptions),
        Route("/api/v1/retained", retained, methods=["GET", "DELETE"]),
        Route("/api/v1/retained/{topic:path}", delete_retained, methods=["DELETE"]),
        Route("/api/v1/publish", publish, methods=["POST"]),
        Route("/static/{name:path}", static_file),
    ]
    app = Starlette(routes=routes, exception_handlers={
        HTTPException: on_http_error, BadRequest: on_bad_request, NotFound: on_not_found,
        Unavailable: on_unavailable, ClientDisconnect: on_client_gone,  # type: ignore[dict-item]
    })
    return TokenAuth(app, broker.config.http_token)
