"""The sample path's bounded queue in front of librdkafka: the oldest sample is dropped when full."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class SampleQueue:
    def __init__(
        self,
        produce: Callable[..., None],
        in_flight: Callable[[], int],
        maxlen: int = 50_000,
        in_flight_limit: int = 20_000,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._produce = produce
        self._ready = ready  # None: always; while false nothing is handed over (the topic is missing)
        self._in_flight = in_flight
        self._q: deque[tuple[str, bytes, bytes]] = deque()
        # put() runs on the NVML polling thread, pump() on both it and the main loop.
        self._lock = threading.Lock()
        self.maxlen = maxlen
        self.in_flight_limit = in_flight_limit
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._q)

    def put(self, topic: str, key: bytes, value: bytes) -> None:
        with self._lock:
            if len(self._q) >= self.maxlen:
                self._q.popleft()
                self.dropped += 1
            self._q.append((topic, key, value))

    def pump(self) -> int:
        """Hand queued samples to librdkafka while it has room; returns how many were handed over."""
        n = 0
        if self._ready is not None and not self._ready():
            return 0
        room = self.in_flight_limit - self._in_flight()
        while room > 0:
            with self._lock:
                if not self._q:
                    break
                topic, key, value = self._q.popleft()
            self._produce(topic, key, value)
            n += 1
            room -= 1
        return n
