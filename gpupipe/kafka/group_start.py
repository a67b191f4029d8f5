"""Where a new consumer group starts reading: at the process's start, so nothing written while the
service was starting is skipped, and nothing older is replayed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka import TopicPartition


def start_offsets(
    consumer: Any, parts: Sequence[TopicPartition], start_ms: int, timeout_s: float = 10.0
) -> list[TopicPartition] | None:
    """Offsets to assign: the committed ones, else the first record at or after `start_ms`.

    None when every partition has a committed offset (the default assignment is right). When no
    record at or after `start_ms` exists yet, the high watermark read *before* that lookup is used:
    any record written since has a later timestamp and so sits at or after it (no gap, no replay).
    """
    found = fresh_start_offsets(consumer, parts, start_ms, timeout_s)
    return None if found is None else found[0]


def fresh_start_offsets(
    consumer: Any, parts: Sequence[TopicPartition], start_ms: int, timeout_s: float = 10.0
) -> tuple[list[TopicPartition], list[TopicPartition]] | None:
    """:func:`start_offsets`, and apart the partitions among them that had no committed offset."""
    committed = consumer.committed(list(parts), timeout=timeout_s)
    fresh = [tp for tp in committed if tp.offset < 0]
    if not fresh:
        return None
    highs = {
        (tp.topic, tp.partition): consumer.get_watermark_offsets(
            TopicPartition(tp.topic, tp.partition), timeout=timeout_s
        )[1]
        for tp in fresh
    }
    found = consumer.offsets_for_times(
        [TopicPartition(tp.topic, tp.partition, start_ms) for tp in fresh], timeout=timeout_s
    )
    at = {(tp.topic, tp.partition): tp.offset for tp in found}
    out = []
    for tp in committed:
        key = (tp.topic, tp.partition)
        if tp.offset >= 0:
            out.append(TopicPartition(tp.topic, tp.partition, tp.offset))
        else:
            off = at.get(key, -1)
            out.append(TopicPartition(tp.topic, tp.partition, off if off >= 0 else highs[key]))
    keys = {(tp.topic, tp.partition) for tp in fresh}
    return out, [tp for tp in out if (tp.topic, tp.partition) in keys]
