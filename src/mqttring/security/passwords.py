"""Password files in mosquitto's format: parse, hash, verify, write.

A file made by ``mosquitto_passwd`` works here unchanged, and one written by
``mqttring passwd`` works in mosquitto.  One entry per line, ``username:hash``:

* ``$7$ITERATIONS$SALT$HASH``: PBKDF2-HMAC-SHA512 (mosquitto 2.x, the default).  ``SALT`` is
  12 random bytes, ``HASH`` the 64-byte derived key, both standard base64 with padding; the
  derivation runs over the *decoded* salt.
* ``$6$SALT$HASH``: one SHA-512 over ``password + salt`` (mosquitto 1.6 and earlier).

Blank lines and lines starting with ``#`` are skipped, as mosquitto does.  Anything else that
is not a valid entry is a ``PasswordFileError`` naming the file and line: a password file
that half loads would lock out the users after the bad line without a word.  So is a second
entry for a user (which one was meant? mosquitto silently takes one of them) and a ``$7$``
count of iterations above ``MAX_ITERATIONS``.

This module does no I/O but ``load``/``write`` and never runs inside the event loop's
hot path: verification is CPU-heavy by design (``mqttring.security.auth`` runs it in a
thread).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from mqttring.config import ConfigError

#: mosquitto's PW_DEFAULT_ITERATIONS and SALT_LEN (``mosquitto_passwd`` writes these).
DEFAULT_ITERATIONS = 101
#: The most PBKDF2 iterations a ``$7$`` entry may ask for (docs/security.md).  Every login
#: of that user runs them: 10 million take seconds of CPU per CONNECT, and an absurd count
#: (``$7$99999999999999999999$...``) would fail every login rather than the file's load.
MAX_ITERATIONS = 10_000_000
SALT_BYTES = 12
_SHA512_BYTES = 64


class PasswordFileError(ConfigError):
    """A password file cannot be read or holds a line that is not a valid entry."""


@dataclass(frozen=True, slots=True)
class PasswordHash:
    """One stored password: ``kind`` 7 (PBKDF2-SHA512) or 6 (salted SHA-512)."""

    kind: int
    salt: bytes
    digest: bytes
    iterations: int = 0

    def verify(self, password: bytes) -> bool:
        """True when ``password`` hashes to this entry (constant-time compare).

        CPU-heavy for ``$7$`` entries: call it from a worker thread.
        """
        if self.kind == 7:
            got = hashlib.pbkdf2_hmac("sha512", password, self.salt, self.iterations,
                                      len(self.digest))
        else:
            got = hashlib.sha512(password + self.salt).digest()
        return hmac.compare_digest(got, self.digest)

    def encode(self) -> str:
        """The hash field as mosquitto writes it."""
        salt = base64.b64encode(self.salt).decode()
        digest = base64.b64encode(self.digest).decode()
        if self.kind == 7:
            return f"$7${self.iterations}${salt}${digest}"
        return f"$6${salt}${digest}"

    @classmethod
    def parse(cls, text: str) -> PasswordHash:
        """The hash field of an entry; ``ValueError`` saying what is wrong with it."""
        parts = text.split("$")
        if len(parts) < 2 or parts[0] != "":
            raise ValueError("the password is not hashed (mqttring passwd -U FILE hashes "
                             "every plain-text line)")
        try:
            if parts[1] == "7" and len(parts) == 5:
                if not parts[2].isascii() or not parts[2].isdigit():
                    raise ValueError(f"iterations {parts[2]!r} is not a number")
                iterations = int(parts[2])
                if not 1 <= iterations <= MAX_ITERATIONS:
                    raise ValueError(f"iterations must be 1 to {MAX_ITERATIONS:,} "
                                     f"(not {iterations:,})")
                return cls(7, _salt(parts[3]), _digest(parts[4], "$7$"), iterations)
            if parts[1] == "6" and len(parts) == 4:
                return cls(6, _salt(parts[2]), _digest(parts[3], "$6$"))
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"malformed hash: {exc}") from None
        raise ValueError(f"unknown hash type {'$'.join(parts[:2])}$ (expected $7$ or $6$)")


def _b64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def _salt(text: str) -> bytes:
    salt = _b64(text)
    if not salt:
        raise ValueError("the salt is empty")
    return salt


def _digest(text: str, kind: str) -> bytes:
    """A full SHA-512 output: a shorter stored hash (a truncated line) would let in every
    password whose hash starts with it (one byte: 1 guess in 256), and an empty one made
    every login an internal error."""
    digest = _b64(text)
    if len(digest) != _SHA512_BYTES:
        raise ValueError(f"a {kind} hash must be {_SHA512_BYTES} bytes (not {len(digest)})")
    return digest


def hash_password(password: bytes, *, iterations: int = DEFAULT_ITERATIONS,
                  salt: bytes | None = None) -> PasswordHash:
    """A new ``$7$`` entry, exactly as ``mosquitto_passwd`` makes one."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password, salt, iterations, _SHA512_BYTES)
    return PasswordHash(7, salt, digest, iterations)


@dataclass(frozen=True, slots=True)
class PasswordFile:
    """The entries of one password file: an immutable ``username -> PasswordHash``."""

    entries: Mapping[str, PasswordHash]

    def get(self, username: str) -> PasswordHash | None:
        return self.entries.get(username)

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def parse(cls, text: str, source: str = "<password file>") -> PasswordFile:
        entries: dict[str, PasswordHash] = {}
        lines: dict[str, int] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, field = line.partition(":")
            if not sep or not user:
                raise PasswordFileError(f"{source}:{number}: expected username:hash")
            if user in lines:
                raise PasswordFileError(f"{source}:{number}: user {user!r} again (first on "
                                        f"line {lines[user]}): keep one entry per user")
            lines[user] = number
            try:
                entries[user] = PasswordHash.parse(field)
            except ValueError as exc:
                raise PasswordFileError(f"{source}:{number}: user {user!r}: {exc}") from None
        return cls(MappingProxyType(entries))

    @classmethod
    def load(cls, path: Path) -> PasswordFile:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise PasswordFileError(f"cannot read password file {path}: {exc}") from None
        return cls.parse(text, str(path))


def format_entries(entries: Iterable[tuple[str, PasswordHash]]) -> str:
    return "".join(f"{user}:{h.encode()}\n" for user, h in entries)


def write_atomically(path: Path, text: str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text``: a reader (a node reloading) sees the old file or the
    new one, never half of one; the file is private to its owner from its first byte."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
