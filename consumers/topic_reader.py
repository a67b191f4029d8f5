"""Read one record type of a gpupipe topic up to its end as of now, without a consumer group.

For reports and for services that restore state at start: every partition from the oldest retained
offset (or from the first offset at or after ``since_ms`` by record timestamp) up to the end offsets
seen when the read began, read_committed. Never commits, so it moves no one's offsets.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.kafka_admin import client_config
from schemas.codec import AvroCodec
from schemas.errors import DecodeError


def read_topic(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    record_name: str,
    *,
    since_ms: int | None = None,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    missing_ok: bool = False,
    on_bad: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Decoded ``record_name`` records of ``topic`` (per partition in offset order)."""
    consumer = Consumer(
        client_config(
            bootstrap,
            extra,
            **{
                "group.id": f"gpupipe-read-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            },
        )
    )
    out: list[dict[str, Any]] = []
    try:
        tmd = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if tmd is None or tmd.error is not None:
            if missing_ok:
                return out
            raise ConfigError(f"topic {topic} does not exist (check --topic-prefix and that its writer ran)")
        parts = sorted(tmd.partitions)
        starts = {p: OFFSET_BEGINNING for p in parts}
        if since_ms is not None and parts:
            found = consumer.offsets_for_times(
                [TopicPartition(topic, p, since_ms) for p in parts], timeout=10
            )
            starts = {tp.partition: tp.offset for tp in found}
        ends: dict[int, int] = {}
        assign = []
        for part in parts:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
            start = starts[part]
            if high <= low or (start >= 0 and start >= high) or (since_ms is not None and start < 0):
                continue  # empty, or nothing that recent
            ends[part] = high
            assign.append(TopicPartition(topic, part, start))
        if not assign:
            return out
        consumer.assign(assign)
        pending = set(ends)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise GpupipeError(
                    f"timed out after {timeout_s:g}s reading {topic} (an open transaction holds "
                    "read_committed readers until it ends); retry, or raise --timeout"
                )
            for msg in consumer.consume(1000, 0.5):
                err = msg.error()
                part = msg.partition()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if msg.offset() >= ends.get(part, 0):
                            pending.discard(part)
                    elif err.fatal():
                        raise GpupipeError(f"reading {topic}: {err.str()}")
                    continue
                if part not in ends or msg.offset() >= ends[part]:
                    pending.discard(part)
                    continue
                try:
                    d = codec.decode(msg.value())
                except DecodeError as exc:
                    if on_bad:
                        on_bad(f"{topic}[{part}]@{msg.offset()}: not a {record_name} record ({exc.reason})")
                    continue
                if d.name == record_name:
                    out.append(d.record)
                if msg.offset() + 1 >= ends[part]:
                    pending.discard(part)
    except KafkaException as exc:
        raise GpupipeError(f"reading {topic}: {exc.args[0].str()}") from exc
    finally:
        consumer.close()
    return out
