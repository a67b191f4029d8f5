"""A true progress offset for standard lag tooling (review W1/W2).

The chargeback group's committed offset is a *checkpoint* (the oldest offset the open windows
depend on), about a window behind the consumer position by design. Burrow, kafka-lag-exporter or
``kafka-consumer-groups --describe`` read committed offsets, so on that group they always show an
hour of lag and cannot tell a healthy instance from a stuck one. This publisher also commits the
real consumer positions to a second, member-less group (``<group id>.progress`` by default) that
lag tooling can watch; it carries no state and nothing reads it back. Best effort: it is not part
of the transaction, and a failure only logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition

from gpupipe.logs import fields

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

    def maybe_publish(self, positions: Mapping[int, int], force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.interval_s:
            return
        changed = {p: o for p, o in positions.items() if self.published.get(p) != o}
        if not changed:
            return
        self.last = now
        req = ConsumerGroupTopicPartitions(
            self.group, [TopicPartition(self.topic, p, o) for p, o in sorted(changed.items())]
        )
        try:
            futures = self.admin.alter_consumer_group_offsets([req])
            for fut in futures.values():
                fut.add_done_callback(self._done)
            self.published.update(changed)
        except Exception as exc:  # best effort: never stops billing
            self.failures += 1
            log.debug("progress offsets not published", extra=fields(group=self.group, error=str(exc)))

    def _done(self, fut: Any) -> None:
        exc = fut.exception()
        if exc is not None:
            self.failures += 1
            log.debug("progress offsets not published", extra=fields(group=self.group, error=str(exc)))
