"""The record ids chargeback already put on its output topic, for partitions restarted without a
checkpoint of ours: an offset reset or a mirror failover (offsets without our metadata), or the
group's offsets gone altogether (expired after ``offsets.retention.minutes``, or deleted).

Such a partition re-processes its input from wherever the offsets now point and re-emits windows
under the ids an earlier process used. The report counts each id once; the dashboard counters
(:mod:`gpupipe_consumers.chargeback.prom_counters`) need the same ids to do so, and only the topic holds
them: this reads it back from ``since_ms`` (the input's retention: nothing older can be re-emitted)
to its end as of the start of the read, in a thread of its own so the loop goes on meanwhile.

A partition without any committed offset is also what every partition of a new deployment is, and
there the output topic is empty: :func:`holds_records_since` asks the topic's offsets first, so a
new deployment holds nothing and reads nothing back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from gpupipe.common.logs import fields
from gpupipe.kafka.acls import CHARGEBACK_DEDUPE_SUFFIX
from gpupipe.kafka.replay import iter_messages
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError

__all__ = ["EmittedIdsReader", "emitted_ids", "holds_records_since"]

log = logging.getLogger("gpupipe.chargeback")


def emitted_ids(messages: Iterable[object], codec: AvroCodec, partitions: set[int]) -> dict[int, set[str]]:
    """``record_id`` of every ChargebackWindow in ``messages`` whose source partition is one of
    ``partitions``, per partition (undecodable records are not ours to count: skipped)."""
    out: dict[int, set[str]] = {p: set() for p in partitions}
    for msg in messages:
        try:
            rec = codec.decode(msg.value(), msg.headers()).record  # type: ignore[attr-defined]
        except DecodeError:
            continue
        part, rid = rec.get("source_partition"), rec.get("record_id")
        if part in out and rid:
            out[part].add(rid)
    return out


def holds_records_since(consumer: Any, topic: str, since_ms: int, timeout_s: float) -> bool:
    """Whether ``topic`` holds a record written at or after ``since_ms``: what a read back from
    there could find. Watermarks first (an empty or missing topic answers at once), then the
    offsets for that time of the partitions that hold anything. Raises KafkaException."""
    md = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if md is None or md.error is not None:
        return False  # not created yet: nothing was ever emitted
    held = []
    for part in sorted(md.partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=timeout_s)
        if high > low:
            held.append(part)
    if not held:
        return False
    found = consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in held], timeout=timeout_s)
    # -1 (the end): nothing that recent there, everything older is past the input's retention.
    if any(tp.error is None and tp.offset >= 0 for tp in found):
        return True
    failed = next((tp.error for tp in found if tp.error is not None), None)
    if failed is not None:
        raise KafkaException(failed)  # a partition that did not answer may hold some
    return False


class EmittedIdsReader:
    """Reads the ids for a set of partitions in a daemon thread and hands them to ``release``
    (partition, ids or None when the read failed: the caller then counts unchecked). :meth:`close`
    ends every read still going and waits for its thread."""

    def __init__(
        self,
        *,
        bootstrap: str,
        topic: str,
        group_id: str,
        codec: AvroCodec,
        extra: dict[str, str] | None,
        release: Callable[[int, set[str] | None], object],
        read: Callable[..., Iterable[object]] = iter_messages,
    ) -> None:
        self.bootstrap, self.topic, self.group_id = bootstrap, topic, group_id
        self.codec, self.extra, self.release, self.read = codec, extra, release, read
        self.threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def start(self, partitions: set[int], since_ms: int) -> threading.Thread:
        self.threads = [t for t in self.threads if t.is_alive()]
        t = threading.Thread(
            target=self._run, args=(set(partitions), since_ms), name="chargeback-emitted-ids", daemon=True
        )
        self.threads.append(t)
        t.start()
        return t

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop every read (within a poll, or once its metadata calls return) and join its thread
        for at most ``timeout_s``. What a stopped read found is not released: the counters go with
        the service. A closed reader stays closed."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.threads = [t for t in self.threads if t.is_alive()]
        if self.threads:
            log.warning(
                "emitted record ids still being read at close", extra=fields(threads=len(self.threads))
            )

    def _until_stopped(self, msgs: Iterable[object]) -> Iterator[object]:
        for msg in msgs:
            if self._stop.is_set():
                return
            yield msg

    def _run(self, partitions: set[int], since_ms: int) -> None:
        if self._stop.is_set():
            return
        msgs: Iterable[object] = ()
        try:
            msgs = self.read(
                self.bootstrap,
                self.topic,
                since_ms=since_ms,
                extra=self.extra,
                missing_ok=True,
                group_prefix=f"{self.group_id}{CHARGEBACK_DEDUPE_SUFFIX}",  # granted by prefix
                stop=self._stop,
            )
            found = emitted_ids(self._until_stopped(msgs), self.codec, partitions)
        except Exception as exc:  # the counters then count unchecked; billing is not affected
            log.warning(
                "cannot read the emitted record ids back: the dashboard counters of these partitions "
                "may count re-emitted windows twice (the report does not)",
                extra=fields(partitions=sorted(partitions), error=str(exc)[:300]),
            )
            for part in sorted(partitions):
                self.release(part, None)
            return
        finally:
            close = getattr(msgs, "close", None)
            if close is not None:
                # a generator cut short closes its consumer now, not when collected; a failure
                # there must not keep the partitions held
                try:
                    close()
                except Exception as exc:
                    log.warning("closing the emitted-ids reader failed", extra=fields(error=str(exc)[:300]))
        if self._stop.is_set():
            return  # cut short: a partial set would count some re-emitted windows again
        for part in sorted(partitions):
            n = self.release(part, found[part])
            log.info(
                "emitted record ids read back",
                extra=fields(partition=part, ids=len(found[part]), counted_held=n),
            )
