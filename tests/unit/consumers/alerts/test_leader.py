"""The alerts HA leader elector (consumers/alerts/leader.py) on assign, revoke, lost and a paused process.

docs/alerts.md (high availability): "A leader that loses the partition stops at once, so two instances
never publish contradictory revisions". The elector is driven here through a stand-in for
confluent_kafka's Consumer that does what librdkafka does with a subscription: the rebalance callbacks
``on_assign`` / ``on_revoke`` / ``on_lost`` run inside ``poll()``, on the polling thread, with lists of
real ``TopicPartition``. The clock is injected, so the local lease (a process paused past the session
timeout) is tested without waiting. The alert sink's fence is checked on a real librdkafka Producer
(no broker needed: a record it accepts sits in its queue, ``len()``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from gpupipe.kafka.sink import KeyedSink
from gpupipe_consumers.alerts import leader as leader_mod
from gpupipe_consumers.alerts.handler import kafka_alert_sink
from gpupipe_consumers.alerts.leader import LEASE_TOPIC, LeaderElector
from gpupipe_consumers.alerts.service import _fence
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import wait_for
from tests.unit.consumers.alerts.test_record import _records

TOPIC = "t." + LEASE_TOPIC


class FakeLeaderConsumer:
    """confluent_kafka.Consumer as the elector uses it: subscribe with rebalance callbacks, poll serves
    them (and nothing else: nobody writes the lease topic), close leaves the group."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.conf = conf
        self._callbacks: dict[str, Callable[[Any, list[TopicPartition]], None]] = {}
        self._pending: list[tuple[str, list[TopicPartition]]] = []
        self._lock = threading.Lock()
        self.served = threading.Event()
        self.closed = False

    def subscribe(
        self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None
    ) -> None:
        self.topics = topics
        self._callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def rebalance(self, kind: str, parts: list[TopicPartition]) -> None:
        """What the group coordinator decided; the callback runs at the next poll()."""
        self.served.clear()
        with self._lock:
            self._pending.append((kind, parts))

    def poll(self, timeout: float = -1) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for kind, parts in pending:
            self._callbacks[kind](self, parts)
        if pending:
            self.served.set()
        threading.Event().wait(min(timeout, 0.01))  # librdkafka waits up to `timeout` for events
        return None

    def close(self) -> None:
        self.closed = True

    # The group's committed offsets (with their metadata), as the coordinator keeps them per group.
    COMMITS: dict[tuple[str, str, int], TopicPartition] = {}

    def committed(self, parts: list[TopicPartition], timeout: float = -1) -> list[TopicPartition]:
        group = self.conf["group.id"]
        return [
            self.COMMITS.get((group, p.topic, p.partition), TopicPartition(p.topic, p.partition, -1001))
            for p in parts
        ]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> None:
        for p in offsets:
            self.COMMITS[(self.conf["group.id"], p.topic, p.partition)] = p


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def elector(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LeaderElector, FakeLeaderConsumer, Clock]]:
    made: list[FakeLeaderConsumer] = []

    def factory(conf: dict[str, Any]) -> FakeLeaderConsumer:
        made.append(FakeLeaderConsumer(conf))
        return made[-1]

    monkeypatch.setattr(leader_mod, "Consumer", factory)
    clock = Clock()
    e = LeaderElector(
        "127.0.0.1:1", prefix="t.", group_id="alerts", instance="a", create_topic=False, clock=clock
    )
    try:
        yield e, made[0], clock
    finally:
        e.stop(5)
        assert made[0].closed, "the elector leaves the group when it stops"


def lead(e: LeaderElector, c: FakeLeaderConsumer) -> None:
    e.start()
    c.rebalance("assign", [TopicPartition(TOPIC, 0)])
    assert e.acquired.wait(5)
    assert e.is_leader and not e.fenced()


def test_leaders_learn_since_when_the_group_is_led(
    elector: tuple[LeaderElector, FakeLeaderConsumer, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A later leader starts the input partitions nobody committed where the first leader started
    # (an XID written while no instance led is then read); the first leader records its start.
    e, c, _ = elector
    FakeLeaderConsumer.COMMITS.clear()
    e.since_ms = 5_000
    lead(e, c)
    assert e.since_ms == 5_000
    (mark,) = c.committed([TopicPartition(TOPIC, 0)])
    assert mark.offset == 0 and mark.metadata == '{"since_ms": 5000}'
    monkeypatch.setattr(leader_mod, "Consumer", FakeLeaderConsumer)
    later = LeaderElector("127.0.0.1:1", prefix="t.", group_id="alerts", instance="b", create_topic=False)
    later.since_ms = 9_000
    try:
        lead(later, later._consumer)  # type: ignore[arg-type]
        assert later.since_ms == 5_000
        assert c.committed([TopicPartition(TOPIC, 0)])[0].metadata == '{"since_ms": 5000}'
    finally:
        later.stop(5)


@pytest.mark.parametrize("how", ["revoke", "lost"])
def test_a_leader_whose_partition_goes_is_fenced_at_once(
    elector: tuple[LeaderElector, FakeLeaderConsumer, Clock], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    e, c, _ = elector
    assert (
        c.conf["group.id"] == "alerts-leader"
        and c.conf["partition.assignment.strategy"] == "cooperative-sticky"
    )
    assert not e.is_leader  # a standby until the coordinator gives it the partition
    lead(e, c)
    assert c.topics == [TOPIC]
    with caplog.at_level(logging.WARNING, "gpupipe.alerts.leader"):
        c.rebalance(how, [TopicPartition(TOPIC, 0)])  # another member took it / the session expired
        assert e.lost.wait(5)
    assert not e.is_leader and e.fenced()
    assert any("leadership lost" in r.getMessage() for r in caplog.records)
    c.rebalance("assign", [TopicPartition(TOPIC, 0)])  # given back later: still fenced (the pod restarts)
    assert c.served.wait(5)
    assert e.fenced() and not e.is_leader


def test_a_cooperative_rebalance_that_revokes_nothing_keeps_the_leader(
    elector: tuple[LeaderElector, FakeLeaderConsumer, Clock],
) -> None:
    e, c, _ = elector
    lead(e, c)
    c.rebalance("revoke", [])  # incremental: a standby joined, the leader keeps its partition
    assert c.served.wait(5)
    assert e.is_leader and not e.lost.is_set()


def test_a_leader_paused_past_the_session_timeout_fences_itself_before_publishing(
    elector: tuple[LeaderElector, FakeLeaderConsumer, Clock],
) -> None:
    # SIGSTOP past the session timeout: the coordinator gave the partition to the standby, but this
    # instance hears so only at its next heartbeat, and its tick or consume thread may run first.
    e, c, clock = elector
    lead(e, c)
    assert e.lease_s == pytest.approx(8.0)  # 10 s session less one 2 s heartbeat interval
    e._stop.set()  # the poll thread no longer stamps the lease, as in a paused process
    assert e._thread is not None
    e._thread.join(5)
    clock.now += 7.9
    assert e.is_leader, "a pause shorter than the lease is no loss"
    clock.now += 0.2
    assert e.fenced() and e.lost.is_set() and not e.is_leader


def test_the_fence_stops_the_service_and_the_sink_publishes_nothing_once_fenced(
    elector: tuple[LeaderElector, FakeLeaderConsumer, Clock],
) -> None:
    e, c, _ = elector
    lead(e, c)
    sink = kafka_alert_sink("127.0.0.1:1", "t.gpu.alerts.v1", AvroCodec())
    sink.fence = e.fenced
    stop = threading.Event()
    fence = threading.Thread(target=_fence, args=(e, stop), name="test-fence")
    fence.start()
    try:
        rec = _records()[0]
        assert queued(sink, rec) == 1, "the leader's record reaches librdkafka's queue"
        c.rebalance("revoke", [TopicPartition(TOPIC, 0)])
        assert e.lost.wait(5)
        assert queued(sink, rec) == 0 and sink.fenced_drops == 1  # a tick or batch still in hand
        wait_for(stop.is_set, 5, "the fence to stop the service")
    finally:
        stop.set()
        fence.join(5)


def queued(sink: KeyedSink, rec: dict[str, Any]) -> int:
    """How many records ``send`` handed to librdkafka: purged unsent (no broker here), each one's
    delivery report comes back as a failure."""
    before = sink.failed
    sink.send(rec)
    sink._producer.purge(in_queue=True, in_flight=True)
    sink._producer.flush(1)
    return sink.failed - before


def test_ha_members_is_unknown_not_a_crash_when_the_broker_does_not_answer() -> None:
    # A fresh cluster's group coordinator may not answer in time: the plain instance starts anyway.
    from gpupipe_consumers.alerts.leader import ha_members

    assert ha_members("127.0.0.1:1", "gpupipe-alerts", timeout_s=0.5) is None
