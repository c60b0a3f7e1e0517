"""Per-source-address limit on failed logins: a token bucket per address, bounded memory.

Why: a client guessing passwords costs the node one PBKDF2 per guess and fills the log.
After ``burst`` failures from one address (refilled at ``burst`` per ``window`` seconds),
CONNECTs from that address are refused at once (CONNACK 5, closed) without verifying
anything, until a token has come back.  Successful logins cost nothing here.

Memory is bounded by ``max_addresses``: past it the address that failed least recently is
forgotten (an attacker spreading over that many addresses gets a fresh budget on some of
them; each still pays one failure per guess).  Pure: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Addresses remembered at most (about 100 bytes each).
MAX_ADDRESSES = 10_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float
    #: The address's going over the budget was announced (``end``); reset once it refills.
    announced: bool = False


class FailureLimiter:
    """``begin(addr, now)`` before verifying a login, ``end(addr, now, failed)`` after it.

    A login being verified holds one failure's token from ``begin`` until ``end`` (which
    gives it back if the login succeeded): the hashing happens in a thread, and logins
    that came together were all verified when only a check came first, 31 of 50
    concurrent wrong passwords against a budget of 10 (a black-box probe), with the bucket
    driven far below zero (locked out for twice the window) and the warning logged 17
    times.  Now at most ``burst`` are verified, the bucket never goes below zero, and the
    warning is logged once per exhaustion."""

    def __init__(self, burst: int, window: float, max_addresses: int = MAX_ADDRESSES) -> None:
        if burst < 0 or window <= 0 or max_addresses < 1:
            raise ValueError("need burst >= 0, window > 0, max_addresses >= 1")
        self.burst = burst
        self.rate = burst / window  # tokens per second
        self.max_addresses = max_addresses
        self._buckets: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return self.burst > 0

    def _refilled(self, addr: str, now: float) -> _Bucket | None:
        bucket = self._buckets.get(addr)
        if bucket is None:
            return None
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate)
        bucket.stamp = now
        if bucket.tokens >= self.burst:
            del self._buckets[addr]  # back to full: nothing worth remembering
            return None
        return bucket

    def _bucket(self, addr: str, now: float) -> _Bucket:
        """``addr``'s bucket, made full if it had none, moved to most recently used."""
        bucket = self._refilled(addr, now)
        if bucket is None:
            if len(self._buckets) >= self.max_addresses:
                del self._buckets[next(iter(self._buckets))]  # least recently used
            bucket = self._buckets[addr] = _Bucket(float(self.burst), now)
        else:
            self._buckets[addr] = self._buckets.pop(addr)  # most recent last
        return bucket

    def blocked(self, addr: str, now: float) -> bool:
        """True when ``addr`` has no failure left in its budget (nothing is taken)."""
        if not self.burst:
            return False
        bucket = self._refilled(addr, now)
        return bucket is not None and bucket.tokens < 1.0

    def begin(self, addr: str, now: float) -> bool:
        """A login from ``addr`` is about to be verified: False if its budget is used up
        (refuse it unchecked), else True with one failure's token held for it."""
        if not self.burst:
            return True
        bucket = self._bucket(addr, now)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def end(self, addr: str, now: float, failed: bool) -> bool:
        """The login ``begin`` let through was verified: a success gives its token back.
        True when this failure left the budget used up and that was not yet announced
        (log it once)."""
        if not self.burst:
            return False
        if not failed:
            bucket = self._refilled(addr, now)
            if bucket is not None:
                bucket.tokens += 1.0
                if bucket.tokens >= self.burst:
                    del self._buckets[addr]
            return False
        bucket = self._refilled(addr, now)
        if bucket is None:  # forgotten meanwhile (memory bound): count the failure afresh
            bucket = self._bucket(addr, now)
            bucket.tokens -= 1.0
        if bucket.tokens < 1.0 and not bucket.announced:
            bucket.announced = True
            return True
        return False

    def __len__(self) -> int:
        return len(self._buckets)


def source_address(peer: str) -> str:
    """The host part of a transport's ``peer`` ("1.2.3.4:5678", "ws:[::1]:80", "?")."""
    host, sep, _port = peer.rpartition(":")
    return host if sep else peer
