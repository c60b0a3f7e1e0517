"""TLS for client listeners (``mqtts``, ``wss``): the server context, the handshake, a transport.

Theory of operation:

* One ``TlsContext`` per node holds the ``ssl.SSLContext`` built from ``certfile``/``keyfile``
  (and ``cafile`` to verify client certificates).  Every new connection takes the context
  current when it is accepted; ``reload()`` builds a fresh one from the files and swaps it
  in, so renewed certificates reach new clients while established connections keep the
  session they negotiated (an ``SSLObject`` never looks at its context again).  A reload
  that fails (a half-written key file) raises ``ConfigError`` and keeps the old context.
* The handshake runs in the connection's own task, never in the accept loop, and is bounded
  by ``limits.connect_timeout``: a client that sends plaintext or garbage, presents a
  certificate the CA did not sign, or stalls half-way is closed, counted
  (``BrokerMetrics.tls_handshake_failures``) and logged at info with its address, and costs
  nobody else anything.
* ``TlsTransport`` is the ``Transport`` of an ``mqtts`` connection: ``trio.SSLStream`` over
  trio's socket stream.  Unlike ``TcpTransport`` it never parks (the TLS layer may hold
  decrypted bytes the kernel cannot see, so an epoll on the socket could miss them) and
  has no ``send_now`` (a TLS record is written by the stream, not by the socket).  The
  plain TCP fast path is untouched by any of this.

Certificate loading is file I/O: done once at start-up, and in a worker thread on reload.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from mqttring.broker.metrics import BrokerMetrics
from mqttring.config import BrokerConfig, ConfigError, format_hostport

if TYPE_CHECKING:
    from cryptography.x509 import Certificate, CertificateRevocationList

log = logging.getLogger("mqttring.broker.tls")

RECEIVE_SIZE = 65536

#: ``tls_min_version`` values and the protocol version each one means.
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def tls_enabled(config: BrokerConfig) -> bool:
    return config.mqtts is not None or config.wss is not None


def build_server_context(config: BrokerConfig) -> ssl.SSLContext:
    """A server ``SSLContext`` from the configured files; ``ConfigError`` (one line) if one
    of them cannot be read or does not hold what it should (a key that does not match its
    certificate, a CA file with no certificate)."""
    if config.certfile is None or config.keyfile is None:
        raise ConfigError("a TLS listener (mqtts, wss) needs certfile and keyfile")
    # Not ``ssl.create_default_context``: it would also trust the system's CAs for client
    # certificates, so any publicly issued certificate would pass ``require_certificate``.
    # Only ``cafile`` signs clients (as in mosquitto); the rest are Python's defaults.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[config.tls_min_version]
    try:
        context.load_cert_chain(config.certfile, config.keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load certfile {config.certfile} with keyfile "
                          f"{config.keyfile}: {_reason(exc)}") from None
    if config.cafile is not None:
        try:
            context.load_verify_locations(cafile=config.cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load cafile {config.cafile}: {_reason(exc)}") from None
    if config.crlfile is not None:
        _load_crls(context, config.crlfile, config.cafile)
    # A client certificate is asked for only when it is required (as mosquitto does):
    # without ``require_certificate`` the CA file has nothing to verify.
    context.verify_mode = ssl.CERT_REQUIRED if config.require_certificate else ssl.CERT_NONE
    return context


#: A PEM block: its label and its base64 body (``-----BEGIN X509 CRL----- ... -----END ...``).
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----", re.DOTALL)
_CRL_LABEL = b"X509 CRL"


def _load_crls(context: ssl.SSLContext, crlfile: Path, cafile: Path | None) -> None:
    """Add ``crlfile``'s revocation lists to ``context`` and check client leaves against them.

    OpenSSL's only way in is ``load_verify_locations``, which takes *certificates* from the
    same file too: one in ``crlfile`` would become a CA trusted to sign client
    certificates.  So the file must hold PEM ``X509 CRL`` blocks and nothing else, each
    one a CRL that parses (``ConfigError`` otherwise, naming the line); the context's
    certificates are counted before and after, in case the file changed between the check
    and the load."""
    from cryptography import x509

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"cannot load crlfile {crlfile}: {why}")

    try:
        data = crlfile.read_bytes()
    except OSError as exc:
        raise refuse(exc.strerror or str(exc)) from None
    issuers: list[Certificate] = []
    if cafile is not None:
        try:
            issuers = x509.load_pem_x509_certificates(cafile.read_bytes())
        except (OSError, ValueError):
            issuers = []  # cafile's own load reports it; here it only names issuers

    def stray(start: int, end: int) -> None:
        """Refuse text between (or around) the blocks: OpenSSL would skip it, but a file
        that is not what it should be is better refused than half read."""
        text = data[start:end]
        if text.strip():
            offset = start + len(text) - len(text.lstrip())
            raise refuse(f"line {line_of(offset)}: not a PEM block (it must hold PEM "
                         "X509 CRLs only)")

    def line_of(offset: int) -> int:
        return data.count(b"\n", 0, offset) + 1

    crls, pos = 0, 0
    for block in _PEM_BLOCK.finditer(data):
        line = line_of(block.start())
        stray(pos, block.start())
        pos = block.end()
        if block.group(1) != _CRL_LABEL:
            label = block.group(1).decode("ascii")
            raise refuse(f"line {line}: a PEM {label} block, not an X509 CRL (it must hold "
                         "CRLs only: a certificate there would be trusted as a CA)")
        try:
            crl = x509.load_pem_x509_crl(block.group(0))
        except ValueError:
            raise refuse(f"line {line}: an X509 CRL block that does not parse") from None
        if issuers:
            _check_issuer(crl, issuers, refuse, line, cafile)
        crls += 1
    stray(pos, len(data))
    if crls == 0:
        raise refuse("no X509 CRL in it")
    trusted = context.cert_store_stats()["x509"]
    try:
        context.load_verify_locations(cafile=crlfile)
    except (OSError, ssl.SSLError) as exc:
        raise refuse(_reason(exc)) from None
    if context.cert_store_stats()["x509"] != trusted:
        raise refuse("it changed while being read and now holds a certificate")
    # The leaf only, as mosquitto's crlfile: a CRL per intermediate CA is not asked for.
    context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF


def _check_issuer(crl: CertificateRevocationList, issuers: list[Certificate],
                  refuse: Callable[[str], ConfigError], line: int, cafile: Path | None
                  ) -> None:
    """A CRL whose issuer is a CA of ``cafile`` but whose signature does not verify with it
    would refuse every client of that CA (``CRL signature failure``): refused at load.  One
    issued by a CA not in ``cafile`` is kept with a warning: it serves only clients that
    send that CA as an intermediate, and is otherwise another cluster's list by mistake."""
    named = [ca for ca in issuers if ca.subject == crl.issuer]
    if not named:
        log.warning("crlfile line %d: a CRL issued by %s, which is not a CA of cafile %s "
                    "(it applies only to clients that send that CA as an intermediate)",
                    line, crl.issuer.rfc4514_string(), cafile)
        return
    for ca in named:
        try:
            if crl.is_signature_valid(ca.public_key()):  # type: ignore[arg-type]
                return
        except TypeError:
            continue  # a key type that cannot sign a CRL
    raise refuse(f"line {line}: a CRL whose signature does not verify with "
                 f"{crl.issuer.rfc4514_string()} of cafile {cafile}")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        # What an operator needs to act on: "certificate revoked", "certificate has
        # expired", "unable to get local issuer certificate" (not "certificate verify failed").
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        if exc.reason:
            return exc.reason.lower().replace("_", " ")
        return "not a PEM file of the expected kind"  # OpenSSL says no more than "PEM lib"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


class TlsContext:
    """The node's current server ``SSLContext``; ``reload()`` swaps in a new one.

    New connections read ``context`` when they are accepted; nothing else holds the old
    one, so the swap is one attribute assignment (atomic for the trio thread).
    """

    def __init__(self, config: BrokerConfig, context: ssl.SSLContext | None = None) -> None:
        """``context``: ``build_server_context(config)`` already built (``mqttring.broker.
        files``); None: build it here."""
        self._config = config
        self.context = build_server_context(config) if context is None else context
        #: Times the files were loaded again (for logs and tests).
        self.reloads = 0

    @property
    def certfile(self) -> Path | None:
        return self._config.certfile

    def reload(self) -> None:
        """Build a context from the files again and use it for new connections.  Blocking
        file I/O: from trio, call ``reload_in_thread``.  On ``ConfigError`` the old context
        stays in use."""
        self.context = build_server_context(self._config)
        self.reloads += 1
        crl = self._config.crlfile
        log.info("TLS certificate %s%s reloaded", self._config.certfile,
                 "" if crl is None else f" and revocation list {crl}")

    async def reload_in_thread(self) -> None:
        """``reload`` in a worker thread, so the event loop never waits for the disk."""
        await trio.to_thread.run_sync(self.reload)


def certificate_identity(stream: trio.SSLStream[trio.SocketStream]) -> str | None:
    """The common name (CN) of the client's verified certificate, or None if it sent none
    (or its subject has no CN)."""
    cert = stream.getpeercert()
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def peer_of(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return format_hostport(host, port)


async def handshake(
    tcp: trio.SocketStream, tls: TlsContext, timeout: float, metrics: BrokerMetrics
) -> trio.SSLStream[trio.SocketStream] | None:
    """The server side of a TLS handshake on a fresh connection, within ``timeout``; None
    (the connection closed, counted and logged) if it does not complete."""
    peer = peer_of(tcp)
    stream = trio.SSLStream(tcp, tls.context, server_side=True)
    reason = ""
    with trio.move_on_after(timeout) as scope:
        try:
            await stream.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            reason = _reason(cause) or type(cause).__name__
    if scope.cancelled_caught:
        reason = f"not completed within {timeout:g}s"
    if not reason:
        _ack_now(tcp)
        return stream
    metrics.tls_handshake_failures += 1
    log.info("TLS handshake with %s failed: %s", peer, reason)
    if not scope.cancelled_caught:
        await _send_alert(stream, tcp)
    # No TLS goodbye: there is no session to end.
    await tcp.aclose()
    return None


async def _send_alert(stream: trio.SSLStream[trio.SocketStream], tcp: trio.SocketStream
                      ) -> None:
    """Send the alert OpenSSL wrote for a failed handshake ("certificate revoked", "unknown
    ca", "certificate required") before the close, as mosquitto does: without it a device
    sees a bare EOF (in TLS 1.3, at its first read after a handshake it thinks succeeded)
    and cannot tell its operator why.  trio leaves it unsent, since the stream is broken
    once the handshake raises; it waits in the stream's outgoing buffer (trio's private
    ``_outgoing`` ``MemoryBIO``: if a trio release renames it, nothing is sent, and
    ``test_e2e_tls.py``'s alert test says so).  Bounded: a client that does not read gets
    one second."""
    outgoing = getattr(stream, "_outgoing", None)
    if not isinstance(outgoing, ssl.MemoryBIO) or not outgoing.pending:
        return
    with trio.move_on_after(1.0), contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await tcp.send_all(outgoing.read())


#: Linux's switch for acknowledging at once rather than after the delayed-ACK timer.
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)


def _ack_now(tcp: trio.SocketStream) -> None:
    """Acknowledge the client's last handshake flight now, not after ~40 ms.

    In TLS 1.3 the client speaks last (its Finished) and then at once sends CONNECT (or the
    WebSocket upgrade).  A client without TCP_NODELAY (mosquitto's and most libraries'
    default) holds that small write back until its Finished is acknowledged (Nagle); trio
    holds the server's session tickets back until its first write (trio issue 819), so the
    kernel has nothing to carry the ACK and waits for its delayed-ACK timer.  Measured on
    loopback: 45 ms per connect without this, 1.4 ms with it.
    """
    if _QUICKACK is not None:
        with contextlib.suppress(OSError):
            tcp.socket.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)


class TlsTransport:
    """An ``mqtts`` connection (see the module docstring for why it never parks)."""

    __slots__ = ("identity", "peer", "stream")

    #: The connection is encrypted (``use_identity_as_username`` applies to it).
    secure = True

    def __init__(self, stream: trio.SSLStream[trio.SocketStream], peer: str,
                 identity: str | None) -> None:
        self.stream = stream
        self.peer = peer
        #: The CN of the client's verified certificate (None: it presented none).
        self.identity = identity

    async def receive(self) -> bytes:
        try:
            return await self.stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""  # a reset, a truncated record: the peer is gone either way

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except trio.ClosedResourceError as exc:
            raise trio.BrokenResourceError("tls stream closed") from exc

    async def aclose(self) -> None:
        await self.stream.aclose()
