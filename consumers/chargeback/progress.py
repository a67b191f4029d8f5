"""A true progress offset for standard lag tooling.

The chargeback group's committed offset is a *checkpoint* (the oldest offset the open windows
depend on), about a window behind the consumer position by design. Burrow, kafka-lag-exporter or
``kafka-consumer-groups --describe`` read committed offsets, so on that group they always show an
hour of lag and cannot tell a healthy instance from a stuck one. This publisher also commits the
real consumer positions to a second, member-less group (``<group id>.progress`` by default) that
lag tooling can watch; it carries no state and nothing reads it back. Best effort: it is not part
of the transaction, and a failure only logs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition

from gpupipe.common.logs import fields

log = logging.getLogger("gpupipe.chargeback")


class ProgressPublisher:
    """Commits consumer positions to ``group`` at most every ``interval_s`` (admin API, no member)."""

    def __init__(
        self,
        admin: Any,
        group: str,
        topic: str,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.admin, self.group, self.topic = admin, group, topic
        self.interval_s = interval_s
        self.clock = clock
        self.last = float("-inf")
        self.published: dict[int, int] = {}
        self.failures = 0
        # Futures are polled from the loop's thread, never given callbacks: a Python callback run by
        # librdkafka's thread while the interpreter shuts down can crash the process.
        self.pending: list[Any] = []

    def maybe_publish(self, positions: Mapping[int, int], force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.interval_s:
            return
        if force:  # at stop: bounded well inside the service's shutdown budget (--shutdown-timeout)
            self._wait(1.0)
        self._reap()
        changed = {p: o for p, o in positions.items() if self.published.get(p) != o}
        if not changed or self.pending:
            return
        self.last = now
        req = ConsumerGroupTopicPartitions(
            self.group, [TopicPartition(self.topic, p, o) for p, o in sorted(changed.items())]
        )
        try:
            futures = self.admin.alter_consumer_group_offsets([req])
            self.pending.extend(futures.values())
            self.published.update(changed)
        except Exception as exc:  # best effort: never stops billing
            self.failures += 1
            log.debug("progress offsets not published", extra=fields(group=self.group, error=str(exc)))

    def _reap(self) -> None:
        still = []
        for fut in self.pending:
            if not fut.done():
                still.append(fut)
                continue
            exc = fut.exception()
            if exc is not None:
                self.failures += 1
                self.published.clear()  # publish everything again next time
                log.debug("progress offsets not published", extra=fields(group=self.group, error=str(exc)))
        self.pending = still

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for fut in self.pending:
            with contextlib.suppress(Exception):  # best effort; _reap counts it
                fut.result(timeout=max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 1.5) -> None:
        """Wait (bounded, a small share of the shutdown budget) for requests in flight, then let the
        admin client go. Progress is best effort: a lost last update only delays lag tooling."""
        self._wait(timeout_s)
        self._reap()
        self.pending = []
        self.admin = None
