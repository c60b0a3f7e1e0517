"""Shared pieces of the raw-socket WebSocket tests: a client frame, a server certificate."""

from __future__ import annotations

from pathlib import Path

import trustme

HOST = "127.0.0.1"


def ws_frame(payload: bytes, opcode: int = 2) -> bytes:
    """One masked client frame; the mask key is zero, so the payload goes as it is."""
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 65536:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def server_cert(ca: trustme.CA, directory: Path) -> tuple[Path, Path]:
    """A certificate for the node's TLS listeners, issued by ``ca``: (cert file, key file)."""
    leaf = ca.issue_cert(HOST, "localhost")
    cert, key = directory / "server.pem", directory / "server.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key
