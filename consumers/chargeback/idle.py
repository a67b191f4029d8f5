"""Idleness detection for input partitions, apart from the loop that feeds it.

A partition whose GPUs stopped sending would never see its event time move, so its last window
would never close and its checkpoint would stay pinned. After ``timeout_s`` without a record, and
only when the partition is caught up (its records are not merely on their way), its watermark is
advanced to *broker time*: the newest LogAppendTime timestamp seen on any partition plus the
(monotonic) time since, or the wall clock before any was seen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from gpupipe.common.logs import fields

log = logging.getLogger("gpupipe.chargeback")


class PartitionIdleness:
    """When each input partition last had a record, and which ones to advance to broker time."""

    def __init__(self, timeout_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.last_input: dict[int, float] = {}
        self.broker_seen: tuple[int, float] | None = None
        self.last_check = float("-inf")

    def saw_broker_time(self, ts_ms: int) -> None:
        """A record with a LogAppendTime timestamp was consumed."""
        if self.broker_seen is None or ts_ms > self.broker_seen[0]:
            self.broker_seen = (ts_ms, self.clock())

    def saw_input(self, partitions: Iterable[int]) -> None:
        now = self.clock()
        for part in partitions:
            self.last_input[part] = now

    def forget(self, partitions: Iterable[int]) -> None:
        for part in partitions:
            self.last_input.pop(part, None)

    def broker_now_ms(self) -> int:
        """Broker time now: the newest LogAppendTime seen plus the time since; else the wall clock."""
        if self.broker_seen is None:
            return int(time.time() * 1000)
        ts, seen = self.broker_seen
        return ts + int((self.clock() - seen) * 1000)

    def due(self, assigned: Iterable[int]) -> list[int]:
        """Partitions without input for the timeout (checked at most once a second)."""
        timeout = self.timeout_s
        now = self.clock()
        if timeout is None or now - self.last_check < min(1.0, timeout):
            return []
        self.last_check = now
        return [p for p in sorted(assigned) if now - self.last_input.setdefault(p, now) >= timeout]

    def advance(
        self,
        assigned: Iterable[int],
        caught_up: Callable[[int], bool],
        advance_idle: Callable[[int, int], bool],
    ) -> None:
        """Advance every idle, caught-up partition's watermark to broker time."""
        broker_ms = None
        for part in self.due(assigned):
            if not caught_up(part):
                continue  # its records are on their way: not idle
            if broker_ms is None:
                broker_ms = self.broker_now_ms()
            if advance_idle(part, broker_ms):
                log.debug("idle partition advanced", extra=fields(partition=part, watermark_ms=broker_ms))
