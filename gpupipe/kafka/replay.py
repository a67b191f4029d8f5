"""Replay one topic up to its end as of now, from a time or from the oldest record, without a group.

For reports and for services that restore state at start: every partition from the oldest retained
offset (or from the first offset at or after ``since_ms`` by record timestamp) up to the end offsets
seen when the read began, read_committed. Never commits, so it moves no one's offsets. The messages
come out raw: decoding belongs to the contract's readers above this floor.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from gpupipe.common.errors import ConfigError, GpupipeError
from gpupipe.kafka.admin import client_config

__all__ = ["iter_messages"]


def iter_messages(
    bootstrap: str,
    topic: str,
    *,
    since_ms: int | None = None,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    missing_ok: bool = False,
    missing_hint: str = "check --topic-prefix and that its writer ran",
    group_prefix: str,
    stop: threading.Event | None = None,
) -> Iterator[Any]:
    """Every committed message of ``topic`` (confluent_kafka ``Message``), per partition in offset
    order, up to the end offsets seen when the read began.

    ``since_ms``: each partition starts at the first offset whose timestamp is at or after it (a
    partition with nothing that recent is skipped). ``group_prefix`` names the private, never
    committing group (the ACL table grants it by prefix). A missing topic is a :class:`ConfigError`
    naming ``missing_hint``, or an empty read with ``missing_ok``. A set ``stop`` ends the read early
    (within a poll, half a second) for a reader in a thread of its own that its owner is closing.
    """
    consumer = _replay_consumer(bootstrap, extra, group_prefix)
    try:
        tmd = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if tmd is None or tmd.error is not None:
            if missing_ok:
                return
            raise ConfigError(f"topic {topic} does not exist ({missing_hint})")
        starts, ends = _ranges(consumer, topic, sorted(tmd.partitions), since_ms)
        pending = {p for p in ends if starts[p] == OFFSET_BEGINNING or starts[p] < ends[p]}
        if not pending:
            return
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(pending)])
        yield from _read_to_ends(consumer, topic, ends, pending, timeout_s, stop)
    except KafkaException as exc:
        raise GpupipeError(f"reading {topic}: {exc.args[0].str()}") from exc
    finally:
        consumer.close()


def _replay_consumer(bootstrap: str, extra: dict[str, str] | None, group_prefix: str) -> Consumer:
    """A consumer in a private group of its own that never commits and reads committed records only."""
    return Consumer(
        client_config(
            bootstrap,
            extra,
            **{
                "group.id": f"{group_prefix}{uuid.uuid4()}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            },
        )
    )


def _ranges(
    consumer: Consumer, topic: str, partitions: list[int], since_ms: int | None
) -> tuple[dict[int, int], dict[int, int]]:
    """Where each non-empty partition starts (the oldest, or the first at or after ``since_ms``) and
    ends (its high watermark now)."""
    ends: dict[int, int] = {}
    starts: dict[int, int] = {}
    for part in partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
        if high > low:
            ends[part] = high
            starts[part] = OFFSET_BEGINNING
    if since_ms is not None and ends:
        wanted = [TopicPartition(topic, p, since_ms) for p in sorted(ends)]
        for tp in consumer.offsets_for_times(wanted, timeout=10):
            if tp.error is None and tp.offset >= 0:
                starts[tp.partition] = tp.offset
            elif tp.error is None:  # nothing that recent: the range is empty here
                starts[tp.partition] = ends[tp.partition]
    return starts, ends


def _read_to_ends(
    consumer: Consumer,
    topic: str,
    ends: dict[int, int],
    pending: set[int],
    timeout_s: float,
    stop: threading.Event | None,
) -> Iterator[Any]:
    """The assigned partitions' records until each reaches its end (``pending`` empties)."""
    deadline = time.monotonic() + timeout_s
    while pending:
        if stop is not None and stop.is_set():
            return
        if time.monotonic() > deadline:
            where = ", ".join(f"[{p}] (end {ends[p]})" for p in sorted(pending))
            raise GpupipeError(
                f"timed out after {timeout_s:g}s reading {topic} partitions {where}: an open "
                "transaction (of a crashed writer) holds read_committed readers until the writer "
                "restarts or the transaction times out; retry, or raise --timeout"
            )
        for msg in consumer.consume(1000, 0.5):
            if _not_a_record(msg, topic, ends, pending):
                continue
            yield msg
            if msg.offset() + 1 >= ends[msg.partition()]:
                pending.discard(msg.partition())


def _not_a_record(msg: Any, topic: str, ends: dict[int, int], pending: set[int]) -> bool:
    """True for an event or a message past its partition's end (which settles that partition)."""
    err = msg.error()
    part = msg.partition()
    if err is not None:
        if err.code() == KafkaError._PARTITION_EOF:
            if msg.offset() >= ends.get(part, 0):
                pending.discard(part)
        elif err.fatal():
            raise GpupipeError(f"reading {topic}: {err.str()}")
        return True
    if part not in ends or msg.offset() >= ends[part]:
        pending.discard(part)
        return True
    return False
