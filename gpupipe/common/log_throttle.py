"""A logging filter that lets one line of each shape through per period and counts the rest."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable


class RepeatThrottle(logging.Filter):
    """Let a log line through once per `every_s` per shape (digits ignored), counting the rest.

    Why: while the broker is down, librdkafka reports every reconnect attempt of every client
    ("Connect to ... failed: Connection refused"), about 20 lines a second per service; the first
    line and a periodic reminder with how many were held back say the same."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = _DIGITS.sub("N", record.getMessage())
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (-1e18, 0))
            if now - last < self.every_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 1000:  # bounded: forget the oldest shapes
                for k in sorted(self._seen, key=lambda k: self._seen[k][0])[:500]:
                    del self._seen[k]
        if held:
            record.msg = f"{record.getMessage()} ({held} similar lines held back)"
            record.args = ()
        return True


_DIGITS = re.compile(r"\d+")
