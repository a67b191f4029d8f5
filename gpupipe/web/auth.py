"""HTTP basic auth against bcrypt hashes, cheap enough to check on every scrape.

bcrypt costs tens of milliseconds a check on purpose; a scraper sends the same header every few
seconds, so outcomes are remembered (bounded, keyed by a SHA-256 of user and password). An unknown
user costs one bcrypt check like a known one, so timing tells nobody who exists.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import threading
from collections.abc import Mapping

log = logging.getLogger("gpupipe.web")

#: bcrypt reads at most 72 bytes of a password; a longer one is refused rather than truncated.
BCRYPT_MAX_PASSWORD = 72


class BasicAuth:
    def __init__(self, users: Mapping[str, bytes], cache_size: int = 1024) -> None:
        import bcrypt

        self._bcrypt = bcrypt
        self._users = dict(users)
        first = next(iter(self._users.values()))
        rounds = int(first[4:6]) if first[4:6].isdigit() else 10
        self._dummy = bcrypt.hashpw(b"not-a-password", bcrypt.gensalt(rounds))
        self._cache: dict[bytes, bool] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def check(self, header: str | None) -> bool:
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
            known = self._cache.get(key)
        if known is not None:
            return known
        hashed = self._users.get(user)
        ok = self._bcrypt.checkpw(password, hashed or self._dummy) and hashed is not None
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[key] = ok
        return ok
