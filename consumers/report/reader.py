"""Stream ChargebackWindow records from Kafka for a report, in bounded memory (review L4).

The report used to read all of ``gpu.chargeback.v1`` (400 days' retention, about 10^8 records for
a 10k-GPU fleet) into a list on every run. Here records are yielded one by one, and a report with a
``--from`` starts each partition at ``offsets_for_times(from - margin)``: a record is emitted after
its window started (in wall-clock time, give or take the bounded clock skew), so nothing of the
range lies before that offset. Records come with their Kafka timestamp (wall-clock emission time),
which the de-duplication below uses to forget keys that can no longer repeat.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.kafka_admin import client_config
from schemas.codec import AvroCodec
from schemas.errors import DecodeError

SEEK_MARGIN_MS = 86_400_000
"""How far before ``--from`` reading starts: covers emission delay, clock skew and slow commits."""

DEDUP_HORIZON_MS = 5 * 86_400_000
"""A record can only be emitted again while its input is retained (gpu.samples.v1 keeps 3 days):
once every partition has been read past a window's end plus this, its keys are forgotten."""


def iter_chargeback_records(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    *,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    on_bad: Callable[[str], None] | None = None,
    since_ms: int | None = None,
) -> Iterator[tuple[dict[str, Any], int]]:
    """(record, Kafka timestamp) of every committed record up to the end offsets seen at the start."""
    consumer = Consumer(
        client_config(
            bootstrap,
            extra,
            **{
                "group.id": f"gpupipe-report-{uuid.uuid4()}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            },
        )
    )
    try:
        md = consumer.list_topics(topic, timeout=10)
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None:
            raise ConfigError(f"topic {topic} does not exist (has chargeback run with this --topic-prefix?)")
        ends: dict[int, int] = {}
        starts: dict[int, int] = {}
        for part in sorted(tmd.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
            if high > low:
                ends[part] = high
                starts[part] = OFFSET_BEGINNING
        if since_ms is not None and ends:
            wanted = [TopicPartition(topic, p, max(0, since_ms - SEEK_MARGIN_MS)) for p in sorted(ends)]
            for tp in consumer.offsets_for_times(wanted, timeout=10):
                if tp.error is None and tp.offset >= 0:
                    starts[tp.partition] = tp.offset
                elif tp.error is None and tp.offset < 0:  # nothing that recent: the range is empty here
                    starts[tp.partition] = ends[tp.partition]
        pending = {p for p in ends if starts[p] == OFFSET_BEGINNING or starts[p] < ends[p]}
        if not pending:
            return
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(pending)])
        deadline = time.monotonic() + timeout_s
        decode = codec.decode
        while pending:
            if time.monotonic() > deadline:
                where = ", ".join(f"[{p}] (end {ends[p]})" for p in sorted(pending))
                raise GpupipeError(
                    f"timed out after {timeout_s:g}s reading {topic} partitions {where}: an open "
                    "transaction of a crashed chargeback instance blocks read_committed readers until "
                    "the instance restarts or its transaction times out; retry, or raise --timeout"
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
                    d = decode(msg.value())
                except DecodeError as exc:
                    if on_bad:
                        on_bad(
                            f"{topic}[{part}]@{msg.offset()}: not a ChargebackWindow record ({exc.reason})"
                        )
                    continue
                if d.name == "ChargebackWindow":
                    yield d.record, msg.timestamp()[1]
                if msg.offset() + 1 >= ends[part]:
                    pending.discard(part)
    except KafkaException as exc:
        raise GpupipeError(f"reading {topic}: {exc.args[0].str()}") from exc
    finally:
        consumer.close()


class Deduplicator:
    """Counts each ``record_id`` once (review L2): an offset reset or a failover that re-processes
    input re-emits records with the same key. Memory is bounded by the keys of windows that ended
    within ``horizon_ms`` of the oldest emission time still being read, not by the topic's size."""

    def __init__(self, horizon_ms: int = DEDUP_HORIZON_MS) -> None:
        self.horizon_ms = horizon_ms
        self.by_end: dict[int, set[str]] = {}
        self.dropped = 0
        self._low = 0  # emission time below which no record can still arrive (approximate, monotonic)
        self._seen_since_prune = 0

    def keep(self, rec: dict[str, Any], emitted_ms: int) -> bool:
        rid = rec.get("record_id")
        if rid is None:  # written before record_id existed
            return True
        end = int(rec["window_end_ms"])
        ids = self.by_end.get(end)
        if ids is None:
            ids = self.by_end[end] = set()
        elif rid in ids:
            self.dropped += 1
            return False
        ids.add(rid)
        self._seen_since_prune += 1
        if self._seen_since_prune >= 10_000:
            self._prune(emitted_ms)
        return True

    def _prune(self, emitted_ms: int) -> None:
        self._seen_since_prune = 0
        # Partitions interleave, so lag the newest emission time by a day before trusting it.
        self._low = max(self._low, emitted_ms - SEEK_MARGIN_MS)
        cutoff = self._low - self.horizon_ms
        for end in [e for e in self.by_end if e < cutoff]:
            del self.by_end[end]

    def keys_held(self) -> int:
        return sum(len(v) for v in self.by_end.values())


def deduplicated(
    records: Iterable[tuple[dict[str, Any], int]], dedup: Deduplicator | None = None
) -> Iterator[dict[str, Any]]:
    """The records of ``records`` (with emission times), each ``record_id`` once."""
    dedup = dedup if dedup is not None else Deduplicator()
    for rec, ts in records:
        if dedup.keep(rec, ts):
            yield rec
