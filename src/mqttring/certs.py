"""``mqttring cert``: a cluster CA and node certificates for cluster TLS (a dev cluster).

``mqttring cert ca DIR`` writes ``DIR/ca.pem`` and ``DIR/ca.key`` (the key readable by its
owner only); ``mqttring cert node DIR NAME [NAME ...]`` writes ``DIR/NAME.pem`` and
``DIR/NAME.key`` for each name, signed by that CA.  A node uses ``--cluster-cafile DIR/ca.pem
--cluster-certfile DIR/NAME.pem --cluster-keyfile DIR/NAME.key``; an operator's admin
commands take the same flags with a certificate of their own (``mqttring cert node DIR
admin``).  Certificates are usable both as TLS server and client (a node is both), and
are identified by the CA that signed them, not by a host name (``mqttring.cluster_tls``).

For production, a real PKI can issue the same: any certificate with both the serverAuth and
clientAuth extended key usages, signed by a CA used only for the cluster.  Keys are ECDSA
P-256, unencrypted (a node starts unattended); validity is ``--days`` (default 825, 1 to
36500).  Each CA gets a subject of its own (``CN=mqttring cluster CA <random id>``): two
clusters' CAs never share a name, so a certificate or a revocation list of one is never
looked up under the other's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 825
#: ``--days`` bounds: under one day is no certificate to run with (and 0 made one valid for
#: the five minutes of clock skew allowed); past 100 years the date overflows.
MIN_DAYS, MAX_DAYS = 1, 36500


class CertError(Exception):
    """The CA is missing or a file would be overwritten (the operator's call to fix)."""


def _check_days(days: int) -> None:
    if not MIN_DAYS <= days <= MAX_DAYS:
        raise CertError(f"--days must be {MIN_DAYS} to {MAX_DAYS} (not {days})")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mqttring cluster"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, private: bool) -> None:
    if path.exists():
        raise CertError(f"{path} exists; remove it first (certificates are never overwritten)")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(directory: Path, name: str | None = None, days: int = DEFAULT_DAYS) -> Path:
    """``ca.pem`` and ``ca.key`` in ``directory`` (created if needed); returns ``ca.pem``.

    ``name``: the CA's common name; None: ``mqttring cluster CA`` and a random id, unique
    to this CA (see the module docstring)."""
    _check_days(days)
    if name is None:
        name = f"mqttring cluster CA {secrets.token_hex(8)}"
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write(directory / "ca.key", _key_pem(key), private=True)
    _write(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return directory / "ca.pem"


def make_node_cert(directory: Path, name: str, days: int = DEFAULT_DAYS) -> tuple[Path, Path]:
    """``NAME.pem``/``NAME.key`` signed by ``directory``'s CA; returns (cert, key) paths."""
    _check_days(days)
    if not name or "/" in name or name.startswith("."):
        raise CertError(f"not a usable certificate name: {name!r}")
    try:
        ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"no usable CA in {directory} ({exc}); run `mqttring cert ca "
                        f"{directory}` first") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{directory / 'ca.key'} is not an ECDSA key made by `mqttring cert ca`")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert_path, key_path


def run(args: argparse.Namespace) -> int:
    try:
        if args.what == "ca":
            print(make_ca(args.dir, days=args.days))
        else:
            for name in args.names:
                cert, key = make_node_cert(args.dir, name, days=args.days)
                print(cert, key)
    except CertError as exc:
        print(f"mqttring cert: {exc}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("cert", help="make a cluster CA and node certificates "
                                                "(cluster TLS, dev clusters)")
    kinds = parser.add_subparsers(dest="what", required=True)
    ca = kinds.add_parser("ca", help="a new cluster CA: DIR/ca.pem, DIR/ca.key")
    ca.add_argument("dir", type=Path)
    node = kinds.add_parser("node", help="DIR/NAME.pem and DIR/NAME.key signed by DIR's CA")
    node.add_argument("dir", type=Path)
    node.add_argument("names", nargs="+", metavar="NAME")
    for sub in (ca, node):
        sub.add_argument("--days", type=int, default=DEFAULT_DAYS,
                         help=f"validity in days ({MIN_DAYS} to {MAX_DAYS}; "
                              f"default {DEFAULT_DAYS})")
        sub.set_defaults(func=run)
