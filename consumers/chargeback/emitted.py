"""The record ids chargeback already put on its output topic, for partitions restarted without a
checkpoint of ours (an offset reset, a mirror failover).

Such a partition re-processes its input from wherever the offsets now point and re-emits windows
under the ids an earlier process used. The report counts each id once; the dashboard counters
(:mod:`gpupipe_consumers.chargeback.prom_counters`) need the same ids to do so, and only the topic holds
them: this reads it back from ``since_ms`` (the input's retention: nothing older can be re-emitted)
to its end as of the start of the read, in a thread of its own so the loop goes on meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from gpupipe.acls import CHARGEBACK_DEDUPE_SUFFIX
from gpupipe.kafka_replay import iter_messages
from gpupipe.logs import fields
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError

__all__ = ["EmittedIdsReader", "emitted_ids"]

log = logging.getLogger("gpupipe.chargeback")


def emitted_ids(messages: Iterable[object], codec: AvroCodec, partitions: set[int]) -> dict[int, set[str]]:
    """``record_id`` of every ChargebackWindow in ``messages`` whose source partition is one of
    ``partitions``, per partition (undecodable records are not ours to count: skipped)."""
    out: dict[int, set[str]] = {p: set() for p in partitions}
    for msg in messages:
        try:
            rec = codec.decode(msg.value()).record  # type: ignore[attr-defined]
        except DecodeError:
            continue
        part, rid = rec.get("source_partition"), rec.get("record_id")
        if part in out and rid:
            out[part].add(rid)
    return out


class EmittedIdsReader:
    """Reads the ids for a set of partitions in a daemon thread and hands them to ``release``
    (partition, ids or None when the read failed: the caller then counts unchecked)."""

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
        self.codec, self.extra, self.release, self._read = codec, extra, release, read
        self.threads: list[threading.Thread] = []

    def start(self, partitions: set[int], since_ms: int) -> threading.Thread:
        t = threading.Thread(
            target=self._run, args=(set(partitions), since_ms), name="chargeback-emitted-ids", daemon=True
        )
        self.threads.append(t)
        t.start()
        return t

    def _run(self, partitions: set[int], since_ms: int) -> None:
        try:
            msgs = self._read(
                self.bootstrap,
                self.topic,
                since_ms=since_ms,
                extra=self.extra,
                missing_ok=True,
                group_prefix=f"{self.group_id}{CHARGEBACK_DEDUPE_SUFFIX}",  # granted by prefix
            )
            found = emitted_ids(msgs, self.codec, partitions)
        except Exception as exc:  # the counters then count unchecked; billing is not affected
            log.warning(
                "cannot read the emitted record ids back: the dashboard counters of these partitions "
                "may count re-emitted windows twice (the report does not)",
                extra=fields(partitions=sorted(partitions), error=str(exc)[:300]),
            )
            for part in sorted(partitions):
                self.release(part, None)
            return
        for part in sorted(partitions):
            n = self.release(part, found[part])
            log.info(
                "emitted record ids read back",
                extra=fields(partition=part, ids=len(found[part]), counted_held=n),
            )
