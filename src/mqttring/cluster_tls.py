"""Mutual TLS for the cluster address: inter-node links, Raft-side RPC and the admin RPC.

Why: the cluster RPC (``mqttring.rpc``) authenticates peers with the shared secret but sends
frames in the clear, which is fine on loopback and a private network, not across one that is
not.  With ``cluster_cafile``/``cluster_certfile``/``cluster_keyfile`` set, every connection to
a cluster address is TLS 1.3 and both ends present a certificate signed by the cluster's own
CA (``mqttring cert`` makes a dev one); the secret handshake still runs inside it, so a peer
needs both a certificate from that CA and the secret.

Host names are not checked: a node is known by its certificate's issuer (the cluster CA,
trusted for nothing else) and by the secret, not by the address it happens to have, which
changes with DHCP, containers and ``:0`` ports.  Neither side trusts the system's CA store.

(pysyncobj's own Raft port is not covered: it is encrypted by pysyncobj with a key derived
from the secret.)
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

from mqttring.config import BrokerConfig, ConfigError


@dataclass(frozen=True, slots=True)
class ClusterTls:
    """The two contexts of one node: for connections it accepts and for those it makes."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, cafile: Path, certfile: Path, keyfile: Path) -> ClusterTls:
        """Both contexts from PEM files; ``ConfigError`` (one line) if one cannot be loaded."""
        return cls(_context(ssl.PROTOCOL_TLS_SERVER, cafile, certfile, keyfile),
                   _context(ssl.PROTOCOL_TLS_CLIENT, cafile, certfile, keyfile))


def _context(protocol: int, cafile: Path, certfile: Path, keyfile: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are mqttring
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load cluster_certfile {certfile} with cluster_keyfile "
                          f"{keyfile}: {_reason(exc)}") from None
    try:
        context.load_verify_locations(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load cluster_cafile {cafile}: {_reason(exc)}") from None
    return context


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason.lower().replace("_", " ") if exc.reason else "not a PEM file"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def cluster_tls(config: BrokerConfig) -> ClusterTls | None:
    """The node's cluster TLS, or None when it is not configured (plain TCP)."""
    if config.cluster_cafile is None or config.cluster_certfile is None \
            or config.cluster_keyfile is None:
        return None
    return ClusterTls.from_files(config.cluster_cafile, config.cluster_certfile,
                                 config.cluster_keyfile)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """``--cluster-cafile/--cluster-certfile/--cluster-keyfile`` for admin commands."""
    parser.add_argument("--cluster-cafile", type=Path,
                        help="cluster CA (PEM), when the cluster speaks TLS")
    parser.add_argument("--cluster-certfile", type=Path,
                        help="certificate signed by the cluster CA (PEM)")
    parser.add_argument("--cluster-keyfile", type=Path, help="its private key (PEM)")


def client_context_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client context the admin flags name, None without them; ``ConfigError`` if only
    some are given or a file cannot be loaded."""
    files = (args.cluster_cafile, args.cluster_certfile, args.cluster_keyfile)
    if all(f is None for f in files):
        return None
    if any(f is None for f in files):
        raise ConfigError("give all of --cluster-cafile, --cluster-certfile, --cluster-keyfile")
    return ClusterTls.from_files(*files).client
