"""Leader election for the alerts HA pair: leadership is ownership of a one-partition topic.

Rules and reasons in full: docs/alerts.md, "Module notes", ``leader.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from gpupipe.common.logs import fields
from gpupipe.kafka import topics
from gpupipe.kafka.admin import client_config, ensure_topics
from gpupipe.lifecycle.startup import process_start_ms

__all__ = ["LEASE_TOPIC", "LeaderElector", "ha_members"]

log = logging.getLogger("gpupipe.alerts.leader")

LEASE_TOPIC = "gpu.alerts.leader.v1"
_LEASE_SPEC = topics.TopicSpec(partitions=1, retention_ms=3_600_000)


def ha_members(
    bootstrap: str, group_id: str, *, extra: Mapping[str, str] | None = None, timeout_s: float = 10.0
) -> list[str] | None:
    """Client ids of the ``--ha`` instances (leader and standbys) that elect through ``group_id``: the
    members of ``<group_id>-leader``. ``None`` when that cannot be told (no broker answer, no DESCRIBE
    right on the group): the caller decides without it.

    A plain (non-HA) instance with the same ``--group-id`` would join the leader's input group and take
    half its partitions, and nothing fences it: it must not start while HA instances use the group."""
    admin = AdminClient(client_config(bootstrap, extra))
    name = f"{group_id}-leader"
    try:
        desc = admin.describe_consumer_groups([name], request_timeout=timeout_s)[name].result(timeout_s)
    except (KafkaException, TimeoutError) as exc:  # a fresh cluster's coordinator may not answer yet
        log.warning("could not describe the HA leader group", extra=fields(group=name, error=repr(exc)))
        return None
    return sorted(m.client_id for m in desc.members)


class LeaderElector:
    """Joins the leader group and tells when this instance leads (``acquired``) and when it lost it."""

    def __init__(
        self,
        bootstrap: str,
        *,
        prefix: str,
        group_id: str,
        instance: str,
        session_timeout_ms: int = 10_000,
        extra: Mapping[str, str] | None = None,
        create_topic: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topics.with_prefix(prefix, LEASE_TOPIC)
        if create_topic:
            ensure_topics(
                bootstrap, [LEASE_TOPIC], prefix=prefix, specs={LEASE_TOPIC: _LEASE_SPEC}, extra=extra
            )
        self.instance = instance
        #: Since when this group has been led: the earliest start of any of its leaders, kept in the
        #: leader group's commit on the lease partition (see :meth:`_record_since`).
        self.since_ms = process_start_ms()
        self.acquired = threading.Event()
        self.lost = threading.Event()
        self._stop = threading.Event()
        heartbeat_ms = max(500, session_timeout_ms // 5)
        #: How long after the last poll began this instance may still count itself the leader.
        self.lease_s = max(0.0, (session_timeout_ms - heartbeat_ms) / 1000)
        self._clock = clock
        self._polled_at = clock()
        self._consumer = Consumer(
            client_config(
                bootstrap,
                extra,
                **{
                    "group.id": f"{group_id}-leader",
                    "client.id": f"gpupipe-alerts-{instance}",
                    "session.timeout.ms": session_timeout_ms,
                    "heartbeat.interval.ms": heartbeat_ms,
                    "partition.assignment.strategy": "cooperative-sticky",
                    "enable.auto.commit": False,
                    "auto.offset.reset": "latest",
                },
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.acquired.is_set() and not self.fenced()

    def fenced(self) -> bool:
        """True once leadership is lost: revoked, the session lost, or the local lease run out (the
        leader group not polled for ``lease_s``: the process was paused; see the module docstring)."""
        if self.lost.is_set():
            return True
        if self.acquired.is_set() and self._clock() - self._polled_at > self.lease_s:
            self._lose("lease expired: the leader group was not polled within the session timeout")
            return True
        return False

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            log.warning("leadership lost: stopping", extra=fields(instance=self.instance, reason=why))
            self.lost.set()

    def _assign(self, consumer: Any, parts: list[Any]) -> None:
        if parts and not self.acquired.is_set():
            self._record_since(consumer, parts[0])
            log.warning(
                "leadership acquired",
                extra=fields(instance=self.instance, topic=self.topic, led_since_ms=self.since_ms),
            )
            self.acquired.set()

    def _record_since(self, consumer: Any, lease: Any) -> None:
        """Learn since when the group has been led, recording this leader's start if it is earlier.

        A new leader starts an input partition nobody has committed at that time, not at its own
        start: an earlier leader may have died before it committed anything there, and what was
        written since would otherwise be skipped. Unknown (no answer): this process's start. Bounded
        well under the lease: this runs inside poll(), whose length the lease check measures."""
        try:
            wait_s = max(0.1, min(2.0, self.lease_s / 3))
            (tp,) = consumer.committed([TopicPartition(lease.topic, lease.partition)], timeout=wait_s)
            if tp.error is not None:  # not "no mark": writing ours would move the group's later
                raise KafkaException(tp.error)
            known = json.loads(tp.metadata)["since_ms"] if tp.offset >= 0 and tp.metadata else None
            if known is None or int(known) > self.since_ms:
                mark = TopicPartition(
                    lease.topic, lease.partition, 0, metadata=json.dumps({"since_ms": self.since_ms})
                )
                consumer.commit(offsets=[mark], asynchronous=True)  # sent by the next poll
            else:
                self.since_ms = int(known)
        except (KafkaException, ValueError, KeyError, TypeError) as exc:
            log.warning("leader group start unknown", extra=fields(error=str(exc)))
        self._polled_at = self._clock()  # the broker answered meanwhile: no pause to count

    def _revoke(self, consumer: Any, parts: list[Any]) -> None:
        if parts and self.acquired.is_set():
            self._lose("partition revoked or session lost")

    def start(self) -> LeaderElector:
        self._consumer.subscribe(
            [self.topic], on_assign=self._assign, on_revoke=self._revoke, on_lost=self._revoke
        )
        self._thread = threading.Thread(target=self._run, name="alerts-leader", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._polled_at = self._clock()  # stamped before: a pause inside poll() leaves it old
            try:
                self._consumer.poll(0.2)  # serves the rebalance callbacks; nobody writes the topic
            except KafkaException as exc:
                log.warning("leader group poll failed", extra=fields(error=str(exc)))
            if self.acquired.is_set() and self._clock() - self._polled_at > self.lease_s:
                self._lose("lease expired: one poll of the leader group outlasted the session timeout")
        try:
            self._consumer.close()  # leaves the group: a standby takes over without waiting
        except Exception:
            log.warning("leader consumer close failed", exc_info=True)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
