"""The input partitions as one chargeback instance holds them, with the consumer that reads them.

Why apart: every part of the service asks the same questions of the input (which partitions are
ours, where is each read from, where does its restored state begin, what did we commit last) and
moves the consumer the same ways (seek back to where the state is, skip what a rebalance made
stale). Kept in one object, the answers cannot drift between the loop, the rebalance callbacks
and the price holds. The consumer is attached once the service starts: building this connects
nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaException, Message, TopicPartition

from gpupipe.common.logs import fields
from gpupipe.kafka.ready import retry
from gpupipe_consumers.chargeback.errors import ChargebackFatalError
from gpupipe_consumers.chargeback.service_config import OP_TIMEOUT_S
from gpupipe_consumers.chargeback.windows import Checkpoint

log = logging.getLogger("gpupipe.chargeback")


class InputPartitions:
    """Assigned partitions, their positions, restored starts and last committed checkpoints."""

    def __init__(self, topic: str, start: str, cooperative: bool) -> None:
        self.topic = topic
        self.start = start  # where a partition without a checkpoint starts: earliest | latest
        self.cooperative = cooperative  # incremental rebalancing: only moved partitions replay
        self.consumer: Any = None
        self.assigned: set[int] = set()
        self.positions: dict[int, int] = {}  # next offset to process, per assigned partition
        self.committed: dict[int, Checkpoint] = {}  # last checkpoint committed (or restored)
        self.starts: dict[int, int] = {}  # where each partition's restored state begins

    def attach(self, consumer: Any) -> None:
        self.consumer = consumer

    def forget(self, part: int) -> None:
        """Forget where ``part`` was read and what was committed of it (its state is gone)."""
        self.positions.pop(part, None)
        self.committed.pop(part, None)

    def read_committed(self, parts: list[int]) -> list[TopicPartition]:
        """The group's committed offsets of ``parts``; waits while the broker is away (an assignment
        can land as it goes), rather than ending the service."""
        topic = self.topic
        return retry(
            lambda: self.consumer.committed([TopicPartition(topic, p) for p in parts], timeout=OP_TIMEOUT_S),
            what=f"committed offsets of {topic}",
        )

    def fresh_start(self, part: int) -> tuple[int, int]:
        """Where a partition without a checkpoint starts (``--start``), and its end: below the end,
        it replays retained input, which an earlier process may have billed already."""
        low, high = retry(
            lambda: self.consumer.get_watermark_offsets(
                TopicPartition(self.topic, part), timeout=OP_TIMEOUT_S
            ),
            what=f"offsets of {self.topic}[{part}]",
        )
        return (low if self.start == "earliest" else high), high

    def high_watermark(self, part: int) -> int | None:
        """The cached end offset of ``part`` (no request), None when unknown."""
        try:
            _, high = self.consumer.get_watermark_offsets(
                TopicPartition(self.topic, part), timeout=0.5, cached=True
            )
        except KafkaException:
            return None
        return high if high >= 0 else None

    def caught_up(self, part: int) -> bool:
        high = self.high_watermark(part)
        return high is not None and self.positions.get(part, high) >= high

    def probe(self) -> None:
        """A metadata request of at most 2 s; raises KafkaException when the cluster does not answer."""
        self.consumer.list_topics(self.topic, timeout=2.0)

    def reposition(self) -> None:
        """Seek every assigned partition to where its restored state begins."""
        # A partition restored since its last record (all of them with eager assignment) starts
        # where its restored state begins; one kept across an incremental rebalance where it was.
        tps = [
            TopicPartition(self.topic, p, self.positions.get(p, self.starts[p]))
            for p in sorted(self.assigned)
            if p in self.starts
        ]
        log.debug("repositioning after an assignment change", extra=fields(starts=self.starts))
        try:
            for tp in tps:
                self.consumer.seek(tp)
        except KafkaException as exc:  # a partition not fetching yet: re-assigning sets positions too
            if self.cooperative:  # assign() is not allowed: end rather than guess
                raise ChargebackFatalError(f"seek failed: {exc.args[0].str()}") from exc
            log.info("seek failed, re-assigning instead", extra=fields(error=exc.args[0].str()))
            self.consumer.assign(tps)

    def contiguous(self, msgs: list[Message]) -> list[Message]:
        """The messages that continue each assigned partition exactly where its state is (after an
        incremental rebalance); a partition with a stale or missing offset is sought back there."""
        expected: dict[int, int] = {}
        broken: set[int] = set()
        out: list[Message] = []
        for m in msgs:
            if m.error() is not None:
                out.append(m)
                continue
            p = m.partition()
            if p not in self.assigned or p in broken:
                continue
            exp = expected.get(p, self.positions.get(p, self.starts.get(p)))
            if exp is None or m.offset() != exp:
                broken.add(p)
                if exp is not None:
                    expected[p] = exp
                continue
            expected[p] = exp + 1
            out.append(m)
        for p in sorted(broken):
            if p in expected:
                self.consumer.seek(TopicPartition(self.topic, p, expected[p]))
        return out
