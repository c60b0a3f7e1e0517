"""Authenticated request/response RPC between cluster members, on the cluster address.

Why this exists
---------------
Joining, leaving, heartbeats, status and "I caught up" reports need a way to talk to a
member before (or besides) Raft.  pysyncobj's own port is not it: its transport unpickles
what it receives and is keyed by Raft addresses.  This is a small, explicit protocol that
the data plane shares: one TCP port per node, ``config.cluster``.  It lives apart from
``mqttring.raft`` because both the metadata service and the data links (and a single
node's admin port) speak it; consensus does not own its transport.

Framing
-------
Every frame is a 4-byte big-endian length followed by a msgpack map (``MAX_FRAME`` caps the
length; a bigger frame is a protocol error and closes the connection).  A connection starts
with a challenge-response handshake, both ways, keyed by ``HMAC-SHA256(cluster secret,
"mqttring-rpc-v1")``::

    server -> {"t": "challenge", "v": 1, "node": S, "nonce": Ns}       (32 random bytes)
    client -> {"t": "auth", "node": C, "nonce": Nc, "mac": H("C" Ns Nc C)}
    server -> {"t": "welcome", "mac": H("S" Nc Ns S)}                   (or it hangs up)

A peer that cannot prove the secret is refused (logged at warning with its address) before
any message kind is looked at.  Frames are not individually MACed.  Without cluster TLS
they are not encrypted either (the cluster network is then assumed private); with it
(``mqttring.cluster_tls``) the whole connection, handshake included, runs inside mutual TLS
and a peer without a certificate from the cluster's CA is refused before it says a word.

After the handshake the client sends either requests::

    {"t": "req", "id": n, "kind": K, "body": {...}}
    <- {"t": "res", "id": n, "ok": true, "body": {...}} | {..., "ok": false, "error": "..."}

or one ``{"t": "stream", "kind": K, "body": {...}}`` frame that hands the whole connection
to the handler registered for K (for long-lived links that batch many messages per write).

Extension point
---------------
``RpcServer.register(kind, handler, schema)`` adds a request kind; ``register_stream(kind,
handler)`` adds a connection-owning kind.  The dispatch hands a handler only a map body of
the shape its ``schema`` names (``check_body``); anything else is refused with a
``BadRequest`` and one warning line, and a frame it cannot dispatch at all (a ``kind`` that
is not a string, a stream body that is not a map) closes the connection (``BadFrame``).
Metadata kinds (and their schemas) are listed in ``mqttring.raft.service``; the data plane
registers its own (prefix them, e.g. ``"data.forward"``) on the same server.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import reprlib
import ssl
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from mqttring.config import BrokerConfig, ConfigError, format_hostport, parse_hostport
from mqttring.errors import ListenError
from mqttring.tcp_options import for_cluster

log = logging.getLogger(__name__)

#: The RPC key is derived from the cluster secret for this purpose only.
RPC_KEY_PURPOSE = "mqttring-rpc-v1"
SECRET_ENV = "MQTTRING_CLUSTER_SECRET"


def cluster_secret(config: BrokerConfig) -> str:
    """The cluster secret from the config, else from ``$MQTTRING_CLUSTER_SECRET``."""
    secret = config.cluster_secret or os.environ.get(SECRET_ENV)
    if not secret:
        raise ConfigError(f"a cluster needs cluster_secret (or ${SECRET_ENV})")
    return secret

MAX_FRAME = 16 * 1024 * 1024
#: Largest frame of the handshake (challenge, auth, welcome: a node id and two 32-byte
#: values), the only frames a peer that has not proved the cluster secret may send.
HANDSHAKE_MAX_FRAME = 64 * 1024
PROTOCOL_VERSION = 1
HANDSHAKE_TIMEOUT = 5.0
_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame or message (their fault)."""


class AuthError(Exception):
    """The handshake failed: the peer does not hold the cluster secret (or we don't)."""


class RpcError(Exception):
    """The remote handler refused the request; the message says why."""


class BadRequest(RpcError):
    """A request whose body does not have the shape its kind needs (not a map, a field
    missing or of the wrong type).  Only a peer holding the cluster secret gets this far,
    so it is a bug or version skew there (or a hostile member): the request is refused
    with this message and the refusal logged as one warning line, not as a handler crash
    with a traceback."""


class BadFrame(ProtocolError):
    """An authenticated peer sent a well-framed map that is not a request or stream frame
    this server can dispatch (a ``kind`` that is not a string, a stream body that is not a
    map, no request id).  Its connection is closed with one warning line: unlike garbage
    bytes, which a network fault can explain, this is a peer's bug worth an operator's
    eye."""


def derive_key(secret: str, purpose: str) -> bytes:
    """A per-purpose key so that the Raft password and the RPC key never coincide."""
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Peer:
    node_id: str
    address: str


class FramedStream:
    """Length-prefixed msgpack frames over a trio stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()
        self._send_lock = trio.Lock()
        #: Largest frame ``receive`` accepts; a stream handler carrying client payloads
        #: (the data links) raises it to fit the broker's packet size limit.
        self.max_frame = MAX_FRAME

    async def send(self, message: dict[str, Any]) -> None:
        await self.send_packed(msgpack.packb(message, use_bin_type=True))

    async def send_packed(self, payload: bytes) -> None:
        """Send a map the caller already packed (and could check the size of)."""
        async with self._send_lock:
            await self.stream.send_all(_LEN.pack(len(payload)) + payload)

    async def _fill(self, size: int) -> None:
        while len(self._buffer) < size:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError("connection closed by peer")
            self._buffer += chunk

    async def receive_bytes(self) -> bytes:
        """The next frame's payload, undecoded: for a stream handler with its own codec
        (the data links decode typed frames, ``mqttring.cluster.messages``)."""
        await self._fill(4)
        (size,) = _LEN.unpack_from(self._buffer)
        if size > self.max_frame:
            raise ProtocolError(f"frame of {size} bytes exceeds {self.max_frame}")
        await self._fill(4 + size)
        payload = bytes(self._buffer[4 : 4 + size])
        del self._buffer[: 4 + size]
        return payload

    async def receive(self) -> dict[str, Any]:
        payload = await self.receive_bytes()
        try:
            message = msgpack.unpackb(payload, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable frame: {exc}") from None
        if not isinstance(message, dict):
            raise ProtocolError("frame is not a map")
        return message

    async def aclose(self) -> None:
        await self.stream.aclose()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


async def _server_handshake(fs: FramedStream, key: bytes, node_id: str) -> str:
    nonce = os.urandom(32)
    await fs.send({"t": "challenge", "v": PROTOCOL_VERSION, "node": node_id, "nonce": nonce})
    # Before the peer proved the secret it may send one small frame: a length prefix of
    # MAX_FRAME had each unauthenticated connection buffer up to 16 MiB.
    fs.max_frame = HANDSHAKE_MAX_FRAME
    reply = await fs.receive()
    fs.max_frame = MAX_FRAME
    peer, cnonce, mac = reply.get("node"), reply.get("nonce"), reply.get("mac")
    if reply.get("t") != "auth" or not isinstance(peer, str) or not isinstance(cnonce, bytes) \
            or not isinstance(mac, bytes):
        raise ProtocolError("expected an auth frame")
    if not hmac.compare_digest(mac, _mac(key, b"C", nonce, cnonce, peer.encode())):
        raise AuthError(f"peer claiming to be {peer!r} does not hold the cluster secret")
    await fs.send({"t": "welcome", "mac": _mac(key, b"S", cnonce, nonce, node_id.encode())})
    return peer


async def _client_handshake(fs: FramedStream, key: bytes, node_id: str) -> str:
    fs.max_frame = HANDSHAKE_MAX_FRAME  # the same bound for the side that did not prove it
    challenge = await fs.receive()
    peer, nonce = challenge.get("node"), challenge.get("nonce")
    if challenge.get("t") != "challenge" or not isinstance(peer, str) \
            or not isinstance(nonce, bytes):
        raise ProtocolError("expected a challenge frame")
    cnonce = os.urandom(32)
    await fs.send({"t": "auth", "node": node_id, "nonce": cnonce,
                   "mac": _mac(key, b"C", nonce, cnonce, node_id.encode())})
    try:
        welcome = await fs.receive()
    except EOFError:
        raise AuthError(f"{peer!r} refused us: wrong cluster secret?") from None
    mac = welcome.get("mac")
    if welcome.get("t") != "welcome" or not isinstance(mac, bytes) or not hmac.compare_digest(
        mac, _mac(key, b"S", cnonce, nonce, peer.encode())
    ):
        raise AuthError(f"{peer!r} could not prove the cluster secret")
    fs.max_frame = MAX_FRAME
    return peer


def _tls_failure(address: str, exc: trio.BrokenResourceError) -> Exception:
    """``AuthError`` when a side refused the other's certificate (or the peer does not speak
    TLS): a configuration fault.  ``EOFError`` when the connection merely broke (the peer
    restarting), which callers retry like any closed connection."""
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLError) and not isinstance(
            cause, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError):
        return AuthError(f"TLS with {address} failed: {cause}")
    return EOFError(f"TLS connection to {address} broken: {cause or exc}")


Handler = Callable[[dict[str, Any], Peer], Awaitable[dict[str, Any]]]
StreamHandler = Callable[[FramedStream, Peer, dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Field:
    """What one key of a request body must hold, checked at the dispatch so that a handler
    indexes its body without guarding every access (a peer's wrong shape used to surface
    as a ``KeyError`` or ``AttributeError`` deep in the handler, logged with a traceback).

    ``types``: the value's allowed types (``type(None)`` for an explicit null; ``bool`` is
    not an ``int`` here, though Python says it is).  ``required``: the key must be there.
    ``items``: for a list, the type every element must have.  ``fields``: for a map, the
    schema of its own keys."""

    types: tuple[type, ...]
    required: bool = False
    items: type | None = None
    fields: Mapping[str, Field] = field(default_factory=dict)


#: A request kind's body: the keys it checks.  Keys not named pass unchecked (a newer peer
#: may send more than this node reads).
Schema = Mapping[str, Field]


def _has_type(value: object, types: tuple[type, ...]) -> bool:
    if type(value) is bool:
        return bool in types
    return isinstance(value, types)


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else "map" if t is dict else t.__name__
                       for t in types)


def check_body(kind: str, body: object, schema: Schema | None = None,
               _path: str = "") -> dict[str, Any]:
    """``body`` if it is a map of the shape ``schema`` describes, else ``BadRequest``
    saying what is wrong (a missing body is an empty map, as clients send ``body or {}``).
    Cheap: a few ``isinstance`` per request, and requests are rare (joins, heartbeats,
    admin commands); the data links do not go through here."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise BadRequest(f"{kind}: {_path or 'the body'} must be a map, "
                         f"not {type(body).__name__}")
    for key, spec in (schema or {}).items():
        name = f"{_path}.{key}" if _path else repr(key)
        if key not in body:
            if spec.required:
                raise BadRequest(f"{kind}: {name} is required")
            continue
        value = body[key]
        if not _has_type(value, spec.types):
            raise BadRequest(f"{kind}: {name} must be {_type_names(spec.types)}, "
                             f"not {type(value).__name__}")
        if spec.items is not None and isinstance(value, list) and not all(
                _has_type(item, (spec.items,)) for item in value):
            raise BadRequest(f"{kind}: {name} must be a list of {spec.items.__name__}")
        if spec.fields and isinstance(value, dict):
            check_body(kind, value, spec.fields, name)
    return body


class RpcServer:
    """Accepts authenticated connections and dispatches frames by ``kind``."""

    def __init__(self, key: bytes, node_id: str, tls: ssl.SSLContext | None = None) -> None:
        self._key = key
        self._node_id = node_id
        #: Server context of cluster TLS (peers must present the cluster CA's certificate).
        self._tls = tls
        self._handlers: dict[str, Handler] = {}
        self._schemas: dict[str, Schema] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        #: Connections refused for a failed handshake (for tests and status).
        self.refused = 0

    def register(self, kind: str, handler: Handler, schema: Schema | None = None) -> None:
        """Serve ``kind`` with ``handler``.  Its body is always a map by the time the
        handler sees it; ``schema`` adds the keys and types it needs (``check_body``)."""
        if kind in self._handlers or kind in self._stream_handlers:
            raise ValueError(f"RPC kind {kind!r} registered twice")
        self._handlers[kind] = handler
        if schema:
            self._schemas[kind] = schema

    def register_stream(self, kind: str, handler: StreamHandler) -> None:
        if kind in self._handlers or kind in self._stream_handlers:
            raise ValueError(f"RPC kind {kind!r} registered twice")
        self._stream_handlers[kind] = handler

    async def serve(self, address: str, *, task_status: trio.TaskStatus[int] =
                    trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``address``; ``task_status.started`` gets the bound port."""
        host, port = parse_hostport(address)
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise ListenError(address, exc) from None
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        """One connection; whatever it does wrong, only it ends (``serve_listeners`` would
        end the whole server, and with it the node, on an escaping exception)."""
        try:
            await self._handle_connection(stream)
        except Exception:
            log.exception("cluster connection handler failed; closing that connection")
            await trio.aclose_forcefully(stream)

    async def _handle_connection(self, tcp: trio.SocketStream) -> None:
        try:
            host, port = tcp.socket.getpeername()[:2]
            address = format_hostport(host, port)
        except OSError:
            address = "?"
        stream: trio.abc.Stream = tcp
        if self._tls is not None:
            stream = trio.SSLStream(tcp, self._tls, server_side=True)
        fs = FramedStream(stream)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                if isinstance(stream, trio.SSLStream):
                    await stream.do_handshake()  # BrokenResourceError: no cluster certificate
                peer = Peer(await _server_handshake(fs, self._key, self._node_id), address)
        except (AuthError, ProtocolError, EOFError, trio.TooSlowError,
                trio.BrokenResourceError) as exc:
            self.refused += 1
            reason = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) \
                and exc.__cause__ is not None else exc
            log.warning("refused cluster connection from %s: %s", address,
                        reason if str(reason) else
                        f"no handshake within {HANDSHAKE_TIMEOUT:g} s"
                        if isinstance(reason, trio.TooSlowError) else type(reason).__name__)
            await trio.aclose_forcefully(stream)
            return
        try:
            await self._dispatch(fs, peer)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except BadFrame as exc:
            log.warning("closing cluster connection from %r (%s): %s", peer.node_id,
                        peer.address, exc)
        except ProtocolError as exc:
            log.debug("closing connection from %s: %s", peer, exc)
        finally:
            await fs.aclose()

    async def _dispatch(self, fs: FramedStream, peer: Peer) -> None:
        while True:
            frame = await fs.receive()
            kind = frame.get("kind")
            t = frame.get("t")
            if not isinstance(kind, str):
                raise BadFrame(f"{reprlib.repr(t)} frame whose kind is "
                               f"{type(kind).__name__}, not a string")
            if t == "stream":
                stream_handler = self._stream_handlers.get(kind)
                if stream_handler is None:
                    raise BadFrame(f"unknown stream kind {reprlib.repr(kind)}")
                body = frame.get("body")
                if body is None:
                    body = {}
                if not isinstance(body, dict):
                    raise BadFrame(f"{kind} stream whose body is {type(body).__name__}, "
                                   "not a map")
                await stream_handler(fs, peer, body)
                return
            if t != "req" or "id" not in frame:
                raise BadFrame(f"unexpected frame {reprlib.repr(t)}" if t != "req"
                               else "request without an id")
            handler = self._handlers.get(kind)
            if handler is None:
                await fs.send({"t": "res", "id": frame["id"], "ok": False,
                               "error": f"unknown kind {kind!r}"})
                continue
            try:
                body = await handler(check_body(kind, frame.get("body"),
                                                self._schemas.get(kind)), peer)
                reply = {"t": "res", "id": frame["id"], "ok": True, "body": body}
            except BadRequest as exc:
                log.warning("refused RPC %r from %r (%s): %s", kind, peer.node_id,
                            peer.address, exc)
                reply = {"t": "res", "id": frame["id"], "ok": False, "error": str(exc)}
            except RpcError as exc:
                reply = {"t": "res", "id": frame["id"], "ok": False, "error": str(exc)}
            except Exception:
                log.exception("RPC handler %r failed", kind)
                reply = {"t": "res", "id": frame["id"], "ok": False, "error": "internal error"}
            await fs.send(reply)


class RpcClient:
    """One authenticated connection; requests are sent one at a time."""

    def __init__(self, fs: FramedStream, peer: str) -> None:
        self._fs = fs
        self.peer = peer
        self._next_id = 0
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, address: str, key: bytes, node_id: str,
                      timeout: float = HANDSHAKE_TIMEOUT, *,
                      tls: ssl.SSLContext | None = None) -> RpcClient:
        """``tls``: the client context of cluster TLS (None: plain TCP).  A TLS handshake
        that fails (a peer outside the cluster CA, or one not speaking TLS) is an
        ``AuthError``, like a wrong secret."""
        host, port = parse_hostport(address)
        with trio.fail_after(timeout):
            tcp = await trio.open_tcp_stream(host, port)
            for_cluster(tcp)
            stream: trio.abc.Stream = tcp
            try:
                fs = FramedStream(stream)
                if tls is None:
                    peer = await _client_handshake(fs, key, node_id)
                else:
                    stream = fs.stream = trio.SSLStream(stream, tls, server_hostname=host)
                    try:
                        await stream.do_handshake()
                    except trio.BrokenResourceError as exc:
                        raise _tls_failure(address, exc) from None
                    try:
                        peer = await _client_handshake(fs, key, node_id)
                    except trio.BrokenResourceError as exc:
                        # TLS 1.3: the server judges our certificate after our side of the
                        # handshake is done, and hangs up on a bad one before its challenge
                        # (as on a wrong secret before its welcome).
                        raise AuthError(f"{address} closed the connection after the TLS "
                                        f"handshake: does it refuse our certificate? "
                                        f"({exc.__cause__ or exc})") from None
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        return cls(fs, peer)

    async def call(self, kind: str, body: dict[str, Any] | None = None,
                   timeout: float = 10.0) -> dict[str, Any]:
        async with self._lock:
            self._next_id += 1
            with trio.fail_after(timeout):
                await self._fs.send({"t": "req", "id": self._next_id, "kind": kind,
                                     "body": body or {}})
                reply = await self._fs.receive()
        if reply.get("t") != "res" or reply.get("id") != self._next_id:
            raise ProtocolError("response does not match request")
        if not reply.get("ok"):
            raise RpcError(str(reply.get("error")))
        return reply.get("body") or {}

    @property
    def stream(self) -> trio.abc.Stream:
        """The connection under the frames: close it forcefully after a call cut off
        mid-way, which leaves the framing unusable."""
        return self._fs.stream

    async def open_stream(self, kind: str, body: dict[str, Any] | None = None) -> FramedStream:
        """Turn this connection into a ``kind`` stream; the client must not ``call`` again."""
        await self._fs.send({"t": "stream", "kind": kind, "body": body or {}})
        return self._fs

    async def aclose(self) -> None:
        await self._fs.aclose()


async def call_once(address: str, key: bytes, node_id: str, kind: str,
                    body: dict[str, Any] | None = None, timeout: float = 10.0, *,
                    tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Connect, make one request, close: for rare calls (join, admin commands)."""
    with trio.fail_after(timeout):
        client = await RpcClient.connect(address, key, node_id, timeout, tls=tls)
        try:
            return await client.call(kind, body, timeout)
        finally:
            await client.aclose()
