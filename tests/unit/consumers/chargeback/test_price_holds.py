"""A partition held for the price agreement through aborts, rebalances and failed reads.

A held partition is paused at its first record that may not be processed yet (``held[P] = H``).
Whatever restores it from its checkpoint C < H (an aborted transaction, the producer replaced
after an outage, a rebalance, lost partitions) must not leave the hold at H: resuming there later
would skip C..H-1, which are never billed. And librdkafka keeps an application pause across
unassign/assign, so a hold forgotten without a resume leaves the partition paused for ever.
Against the in-memory broker of ``test_chargeback_service``, whose consumer keeps a pause across
``assign`` as librdkafka does (``tests/integration/consumers/chargeback/test_price_hold_rebalance.py`` shows
it on a real broker).
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

from confluent_kafka import KafkaError, TopicPartition

from gpupipe.common.durations import format_iso_ms
from gpupipe.domain.price_schedule import fingerprint
from tests.unit.consumers.chargeback.test_failures import ErrorMsg
from tests.unit.consumers.chargeback.test_price_rollout import (
    IN,
    NEW,
    OLD,
    Owning,
    V,
    expected,
    instance,
    prices_by_window,
    records,
    run,
    split_input,
)
from tests.unit.consumers.chargeback.test_service import Broker, comparable


class HeldThen(Owning):
    """Once partition 0 is held: ``event()`` on the ``at``-th empty loop while paused, then (a few
    loops later) the other partition's checkpoint shows the new prices, so the hold is lifted."""

    at = 1
    agree_at = 4
    waited = 0

    def event(self) -> None:
        raise NotImplementedError

    def consume(self, n: int, timeout: float) -> list:
        out = super().consume(n, timeout)
        if self.paused and self.waited < self.agree_at:
            self.waited += 1
            self.idle = 0
            if self.waited == self.at:
                self.event()
            if self.waited == self.agree_at:
                off, meta = self.b.offsets[1]
                data = json.loads(meta)
                data["px"] = [list(e) for e in fingerprint(NEW)]
                self.b.offsets[1] = (off, json.dumps(data))
        return out


def run_held(consumer: HeldThen, broker: Broker) -> object:
    """Partition 0 goes on with the new table while partition 1's instance still has the old one."""
    svc = instance(broker, [0], NEW, consumer)
    consumer.stop = svc._stop_event  # type: ignore[attr-defined]
    svc.run(svc._stop_event)  # type: ignore[attr-defined]
    return svc


def rollout() -> tuple[Broker, list]:
    log, before, fed = split_input()
    broker = Broker(before)
    run(broker, [0], OLD)
    run(broker, [1], OLD)
    broker.log = log  # input goes on across V
    return broker, fed


def partition0_exact(broker: Broker, fed: list) -> None:
    ours = [r for r in records(broker) if r["source_partition"] == 0]
    want = [r for r in expected(fed, NEW) if dict(r)["source_partition"] == 0]
    got = comparable(ours)
    assert sum(dict(r)["allocated_gpu_seconds"] for r in got) == sum(
        dict(r)["allocated_gpu_seconds"] for r in want
    )
    assert got == want  # nothing lost, nothing twice


def test_an_abort_while_held_loses_nothing() -> None:
    """Review finding 1: the abort restored C and kept held[0] = H; the resume sought to H."""
    broker, fed = rollout()

    class AbortWhileHeld(HeldThen):
        armed = True

        def event(self) -> None:
            pass

        def pause(self, tps: list[TopicPartition]) -> None:
            """The commit right after the hold began (of what came before it) aborts."""
            super().pause(tps)
            if self.armed:
                self.armed = False
                self.b.fail = [KafkaError(KafkaError._STATE, "test abort", txn_requires_abort=True)]

    consumer = AbortWhileHeld(broker, threading.Event(), [0])
    svc = run_held(consumer, broker)
    assert svc.metrics.transactions.labels("aborted")._value.get() >= 1  # type: ignore[attr-defined]
    assert not consumer.paused and svc.held == {}  # type: ignore[attr-defined]
    partition0_exact(broker, fed)


def test_a_producer_replaced_after_an_outage_while_held_loses_nothing() -> None:
    """The same through _broker_answers: all brokers down, back, producer replaced, rewound."""
    broker, fed = rollout()

    class OutageWhileHeld(HeldThen):
        down = False

        def event(self) -> None:
            self.down = True

        def consume(self, n: int, timeout: float) -> list:
            if self.down:
                self.down = False
                self.idle = 0
                return [ErrorMsg(KafkaError(KafkaError._ALL_BROKERS_DOWN, "all brokers down"))]
            return super().consume(n, timeout)

    consumer = OutageWhileHeld(broker, threading.Event(), [0])
    svc = run_held(consumer, broker)
    assert svc.abandoned_producers == 1  # type: ignore[attr-defined]
    assert not consumer.paused and svc.held == {}  # type: ignore[attr-defined]
    partition0_exact(broker, fed)


def test_a_rebalance_while_held_resumes_the_partition() -> None:
    """Review finding 2: eager revoke + assign of the same partition forgot the hold and never
    resumed it; librdkafka's pause outlived the assignment, so it was never read again."""
    broker, fed = rollout()

    class RebalanceWhileHeld(HeldThen):
        def event(self) -> None:
            self.on_revoke(self, [TopicPartition(IN, 0)])
            self.on_assign(self, [TopicPartition(IN, 0)])

    consumer = RebalanceWhileHeld(broker, threading.Event(), [0])
    svc = run_held(consumer, broker)
    assert svc.rebalances >= 3  # type: ignore[attr-defined]
    assert not consumer.paused, "partition 0 stays paused for ever"
    partition0_exact(broker, fed)


def test_lost_partitions_while_held_are_resumed() -> None:
    broker, fed = rollout()

    class LostWhileHeld(HeldThen):
        def event(self) -> None:
            self.on_lost(self, [TopicPartition(IN, 0)])
            self.on_assign(self, [TopicPartition(IN, 0)])

    consumer = LostWhileHeld(broker, threading.Event(), [0])
    run_held(consumer, broker)
    assert not consumer.paused
    partition0_exact(broker, fed)


def test_a_failed_read_of_the_other_checkpoints_never_lifts_a_hold() -> None:
    """Review 6(b): an OffsetFetch answering an error for the other partition was taken as "no
    fingerprint", i.e. agreement: the hold was lifted while that partition still priced the
    windows after V the old way. Here the old instance, which had not read the new one's first
    commit yet, billed partition 1 past V while the new one held; an errored read then let the new
    one bill the same windows at the new price."""
    broker, _ = rollout()

    class FlakyFetch(Owning):
        waited = 0  # empty loops while paused, each with a failed check of partition 1

        def consume(self, n: int, timeout: float) -> list:
            out = super().consume(n, timeout)
            if self.paused and self.waited < 6:
                self.waited += 1
                self.idle = 0
                if self.waited == 1:  # meanwhile: the old instance, not aware of the change yet
                    old_b = instance(self.b, [1], OLD)
                    old_b.prices_agreement.update = lambda others, lift=True: False  # type: ignore[method-assign]
                    old_b.run(old_b._stop_event)  # type: ignore[attr-defined]
            return out

        def committed(self, tps: list[TopicPartition], timeout: float) -> list:
            if self.waited and [tp.partition for tp in tps] == [1]:  # the check of the others
                err = KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT, "unstable offset commit")
                return [SimpleNamespace(topic=IN, partition=1, offset=-1001, metadata=None, error=err)]
            return super().committed(tps, timeout)

    consumer = FlakyFetch(broker, threading.Event(), [0])
    svc = instance(broker, [0], NEW, consumer)
    consumer.stop = svc._stop_event  # type: ignore[attr-defined]
    svc.run(svc._stop_event)  # type: ignore[attr-defined]
    assert consumer.waited == 6  # it kept waiting for partition 1's instance (until stopped)
    assert max(r["window_start_ms"] for r in records(broker) if r["source_partition"] == 1) >= V
    assert {w: p for w, p in prices_by_window(broker).items() if len(p) > 1} == {}
    assert max(r["window_start_ms"] for r in records(broker) if r["source_partition"] == 0) < V


def test_a_hold_is_reported_in_health_and_names_the_other_instance() -> None:
    """Review finding 5: /healthz said nothing of a hold. It stays 200 (a hold is expected during
    every rolling update) but says degraded, since when, and which instance has the other table;
    the metric names it too (for the ChargebackPriceHold runbook)."""
    broker, fed = rollout()
    seen: dict[str, object] = {}

    class Watch(HeldThen):
        svc: object = None

        def event(self) -> None:
            svc = self.svc
            seen["health"] = svc.health()  # type: ignore[attr-defined]
            reg = svc.registry  # type: ignore[attr-defined]
            seen["other"] = reg.get_sample_value(
                "gpupipe_chargeback_price_other_table_from_seconds", {"partition": "1", "writer": "svc"}
            )

    consumer = Watch(broker, threading.Event(), [0])
    svc = instance(broker, [0], NEW, consumer)
    consumer.svc = svc
    consumer.stop = svc._stop_event  # type: ignore[attr-defined]
    svc.run(svc._stop_event)  # type: ignore[attr-defined]
    ok, detail = seen["health"]  # type: ignore[misc]
    assert ok and "price hold" in detail["degraded"]
    hold = detail["price_hold"]
    assert hold["held_partitions"] == [0] and hold["other_tables"] == {"1": "svc"}
    assert hold["windows_from"] == format_iso_ms(V) and hold["for_s"] >= 0
    assert seen["other"] == V / 1000
    assert "price_hold" not in svc.health()[1]  # they agree again: no longer degraded
    partition0_exact(broker, fed)
