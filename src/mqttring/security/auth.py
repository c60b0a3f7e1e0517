"""Who may connect: the password file, anonymous access and the failed-login limit.

Theory of operation
-------------------
``Authenticator.check(username, password, peer)`` is the one seam the broker core asks on
CONNECT (a TLS listener that takes the username from a client certificate feeds the same
call).  It never stalls the event loop for other clients:

* PBKDF2 runs in a worker thread under a small ``trio.CapacityLimiter``, so guesses cannot
  take every thread either.
* Recent successes are cached per password-file snapshot, keyed by username and a keyed
  hash of the password (the password itself is never kept): a reconnect storm costs one
  PBKDF2 per user.  ``reload()`` swaps in a new snapshot, which starts with an empty cache,
  so a changed or removed password stops working at once.
* Failures are counted per source address (``mqttring.security.ratelimit``); an address
  over its budget is refused without verifying anything.

``reload()`` reads the file into a new immutable ``PasswordFile`` and swaps it in one
assignment: a check in flight finishes against the snapshot it started with (and fails if
the new one removed or changed that user's entry meanwhile).  A file that
does not parse leaves the old one in force and raises ``PasswordFileError``.  It returns the
users whose entry was removed or changed, whose connections the broker core then closes
(``BrokerCore.reload_security``, as mosquitto 2 does).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from mqttring.config import BrokerConfig
from mqttring.logs import clipped
from mqttring.security.passwords import PasswordFile
from mqttring.security.ratelimit import FailureLimiter, source_address

log = logging.getLogger("mqttring.security")

#: Successful (user, password) pairs remembered per snapshot; cleared when full.
CACHE_SIZE = 1024
#: Threads hashing passwords at once (the node's other blocking work keeps the rest).
HASH_THREADS = 2


class AuthOutcome(enum.Enum):
    ACCEPTED = "accepted"
    #: No username where one is needed, or a username with no way to check it.
    NOT_AUTHORIZED = "not authorized"
    BAD_CREDENTIALS = "bad username or password"
    #: Too many failures from the source address: refused without verifying.
    RATE_LIMITED = "too many failed logins from this address"


@dataclass(slots=True)
class _Snapshot:
    """One loaded password file and the successes verified against it."""

    passwords: PasswordFile
    ok: dict[tuple[str, bytes], None] = field(default_factory=dict)


class Authenticator:
    def __init__(
        self,
        *,
        allow_anonymous: bool = True,
        password_file: Path | None = None,
        failures_allowed: int = 10,
        failure_window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        passwords: PasswordFile | None = None,
    ) -> None:
        """``passwords``: ``password_file`` already loaded (``mqttring.broker.files``);
        None: load it here."""
        self.allow_anonymous = allow_anonymous
        self.password_file = password_file
        self.limiter = FailureLimiter(failures_allowed, failure_window)
        self._clock = clock
        self._key = secrets.token_bytes(32)  # cache keys: useless outside this process
        self._threads = trio.CapacityLimiter(HASH_THREADS)
        self._snapshot: _Snapshot | None = None
        if password_file is not None:
            self._snapshot = _Snapshot(
                PasswordFile.load(password_file) if passwords is None else passwords)

    @classmethod
    def from_config(cls, config: BrokerConfig,
                    passwords: PasswordFile | None = None) -> Authenticator:
        return cls(
            allow_anonymous=config.allow_anonymous,
            password_file=config.password_file,
            failures_allowed=config.auth_failures_allowed,
            failure_window=config.auth_failure_window,
            passwords=passwords,
        )

    @property
    def passwords(self) -> PasswordFile | None:
        """The password file in force (None: no ``password_file``)."""
        snapshot = self._snapshot
        return None if snapshot is None else snapshot.passwords

    def reload(self) -> frozenset[str]:
        """Read the password file again and swap it in (see the module docstring); the
        users whose entry was removed or changed (their old password no longer works)."""
        if self.password_file is None:
            return frozenset()
        before = self.passwords
        passwords = PasswordFile.load(self.password_file)
        self._snapshot = _Snapshot(passwords)
        log.info("password file %s loaded: %d users", self.password_file, len(passwords))
        if before is None:
            return frozenset()
        return frozenset(user for user, entry in before.entries.items()
                         if passwords.get(user) != entry)

    async def check(self, username: str | None, password: bytes | None,
                    peer: str) -> AuthOutcome:
        if username is None:
            return AuthOutcome.ACCEPTED if self.allow_anonymous else AuthOutcome.NOT_AUTHORIZED
        snapshot = self._snapshot
        if snapshot is None:
            # No password file: a username proves nothing; mosquitto lets it in exactly
            # when anonymous clients are let in.
            return AuthOutcome.ACCEPTED if self.allow_anonymous else AuthOutcome.NOT_AUTHORIZED
        addr = source_address(peer)
        if not self.limiter.begin(addr, self._clock()):
            log.debug("refusing a login for %r from %s unchecked: too many failures",
                      clipped(username), peer)
            return AuthOutcome.RATE_LIMITED
        try:
            good = await self._verify(snapshot, username, password)
        except BaseException:  # cancelled (the client left): nothing was learnt
            self.limiter.end(addr, self._clock(), failed=False)
            raise
        if good:
            self.limiter.end(addr, self._clock(), failed=False)
            return AuthOutcome.ACCEPTED
        if self.limiter.end(addr, self._clock(), failed=True):
            log.warning("failed logins from %s reached %d within %.0f s: refusing its "
                        "CONNECTs unchecked for a while (last user %r)", addr,
                        self.limiter.burst, self.limiter.burst / self.limiter.rate,
                        clipped(username))
        return AuthOutcome.BAD_CREDENTIALS

    async def _verify(self, snapshot: _Snapshot, username: str,
                      password: bytes | None) -> bool:
        """Whether ``password`` is ``username``'s in ``snapshot`` (and still is in the file
        in force once the hash is done)."""
        if password is None:
            # No password field is not an empty password: a user of the file whose
            # password is "" must still send it (mosquitto refuses this CONNECT too).
            return False
        key = (username, hmac.new(self._key, password, hashlib.sha256).digest())
        if key in snapshot.ok:
            return True
        entry = snapshot.passwords.get(username)
        good = entry is not None and await trio.to_thread.run_sync(
            entry.verify, password, limiter=self._threads)
        current = self._snapshot
        if good and current is not snapshot and (
                current is None or current.passwords.get(username) != entry):
            return False  # a reload removed or changed the entry while we hashed
        if good:
            if len(snapshot.ok) >= CACHE_SIZE:
                snapshot.ok.clear()
            snapshot.ok[key] = None
        return good


def revoked_users(old: Authenticator, new: Authenticator) -> frozenset[str]:
    """The users of ``old``'s password file whose entry ``new``'s lacks or has changed; none
    when either has no password file (no file: usernames prove nothing either way)."""
    before, after = old.passwords, new.passwords
    if before is None or after is None:
        return frozenset()
    return frozenset(user for user, entry in before.entries.items()
                     if after.get(user) != entry)
