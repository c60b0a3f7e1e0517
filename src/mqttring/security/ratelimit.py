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


class FailureLimiter:
    """``blocked(addr, now)`` before verifying; ``failed(addr, now)`` after a failure."""

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

    def blocked(self, addr: str, now: float) -> bool:
        """True when ``addr`` has no failure left in its budget."""
        if not self.burst:
            return False
        bucket = self._refilled(addr, now)
        return bucket is not None and bucket.tokens < 1.0

    def failed(self, addr: str, now: float) -> bool:
        """Count one failure; True when it used up the address's budget (log it once)."""
        if not self.burst:
            return False
        bucket = self._refilled(addr, now)
        if bucket is None:
            if len(self._buckets) >= self.max_addresses:
                del self._buckets[next(iter(self._buckets))]  # least recently failed
            bucket = self._buckets[addr] = _Bucket(float(self.burst), now)
        else:
            self._buckets[addr] = self._buckets.pop(addr)  # most recent last
        bucket.tokens -= 1.0
        return bucket.tokens < 1.0

    def __len__(self) -> int:
        return len(self._buckets)


def source_address(peer: str) -> str:
    """The host part of a transport's ``peer`` ("1.2.3.4:5678", "ws:[::1]:80", "?")."""
    host, sep, _port = peer.rpartition(":")
    return host if sep else peer
