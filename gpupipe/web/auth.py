"""HTTP basic auth against bcrypt hashes, cheap enough to check on every scrape, and bounded in
what wrong passwords cost.

bcrypt costs tens of milliseconds a check on purpose; a scraper sends the same header every few
seconds, so outcomes are remembered (bounded, keyed by a SHA-256 of user and password): good ones
apart from bad ones, so that a flood of wrong passwords never pushes a scraper's out. An unknown
user costs one bcrypt check like a known one, so timing tells nobody who exists.

What wrong passwords cost the service: each client address may fail
``FAILED_AUTH_BURST`` checks at once, refilled one per ``FAILED_AUTH_INTERVAL_S``; past that its
unknown credentials are refused without a check (remembered good ones still pass). At most
``BCRYPT_CONCURRENCY`` checks run at once, so clients at many addresses take at most that many
cores between them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import threading
import time
from collections.abc import Mapping

log = logging.getLogger("gpupipe.web")

#: bcrypt reads at most 72 bytes of a password; a longer one is refused rather than truncated.
BCRYPT_MAX_PASSWORD = 72
#: Failed checks one client address may make at once ...
FAILED_AUTH_BURST = 10
#: ... and the seconds that earn it one more (about 5% of a core at bcrypt's default cost 10).
FAILED_AUTH_INTERVAL_S = 1.0
#: bcrypt checks running at once, whoever asks.
BCRYPT_CONCURRENCY = 1
#: Client addresses whose failures are counted; past it, those that earned a full budget back
#: are forgotten first.
MAX_TRACKED_CLIENTS = 4096


class _FailureBudget:
    """Per client address, a token bucket of bcrypt checks that may fail."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def _tokens(self, client: str, now: float) -> float:
        tokens, then = self._buckets.get(client, (FAILED_AUTH_BURST, now))
        return min(FAILED_AUTH_BURST, tokens + (now - then) / FAILED_AUTH_INTERVAL_S)

    def spend(self, client: str) -> bool:
        now = time.monotonic()
        tokens = self._tokens(client, now)
        if tokens < 1:
            return False
        if client not in self._buckets and len(self._buckets) >= MAX_TRACKED_CLIENTS:
            full = [c for c in self._buckets if self._tokens(c, now) >= FAILED_AUTH_BURST]
            # forget those whose budget is whole again, else the one that failed longest ago: a
            # new address must never hand every spent budget back at once
            for c in full or [min(self._buckets, key=lambda c: self._buckets[c][1])]:
                del self._buckets[c]
        self._buckets[client] = (tokens - 1, now)
        return True

    def refund(self, client: str) -> None:
        now = time.monotonic()
        if client in self._buckets:
            self._buckets[client] = (min(FAILED_AUTH_BURST, self._tokens(client, now) + 1), now)


class BasicAuth:
    def __init__(self, users: Mapping[str, bytes], cache_size: int = 1024) -> None:
        import bcrypt

        self._bcrypt = bcrypt
        self._users = dict(users)
        first = next(iter(self._users.values()))
        rounds = int(first[4:6]) if first[4:6].isdigit() else 10
        self._dummy = bcrypt.hashpw(b"not-a-password", bcrypt.gensalt(rounds))
        self._good: set[bytes] = set()
        self._bad: set[bytes] = set()
        self._cache_size = cache_size
        self._failures = _FailureBudget()
        self._lock = threading.Lock()
        self._checks = threading.Semaphore(BCRYPT_CONCURRENCY)
        self.refused_unchecked = 0  # credentials refused without a check: the client's budget was spent

    def check(self, header: str | None, client: str = "") -> bool:
        """Whether ``header`` (an ``Authorization`` value) names a user and its password;
        ``client`` (the client's address) is whose failure budget an unknown credential spends."""
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user_b, _, password = base64.b64decode(header[6:].strip(), validate=True).partition(b":")
            user = user_b.decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        if len(password) > BCRYPT_MAX_PASSWORD:
            log.warning("basic auth: a password longer than %d bytes was refused", BCRYPT_MAX_PASSWORD)
            return False
        key = hashlib.sha256(user_b + b"\0" + password).digest()
        with self._lock:
            if key in self._good:
                return True
            if key in self._bad:
                return False
            # spent before the check, given back when it passes: concurrent guesses cannot overdraw
            if not self._failures.spend(client):
                self.refused_unchecked += 1
                return False
        hashed = self._users.get(user)
        with self._checks:
            ok = self._bcrypt.checkpw(password, hashed or self._dummy) and hashed is not None
        with self._lock:
            seen = self._good if ok else self._bad
            if len(seen) >= self._cache_size:
                seen.clear()
            seen.add(key)
            if ok:
                self._failures.refund(client)
        return ok
