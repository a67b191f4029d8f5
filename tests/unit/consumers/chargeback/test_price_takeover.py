"""Review 6(a): a rolling update of the price table, with an instance's partitions taken over.

While the new instance ``a`` restarts, its partitions move to the old instance ``b`` (eager
rebalance). ``b`` used to see the new table nowhere any more (it reads only the partitions it does
not own), billed the windows after the change at the old price, and rewrote ``a``'s fingerprint
with the old one; every new instance was then refused at start, with a message naming only its
own partition's horizon. Now ``b`` holds a taken-over partition where the tables differ and keeps
committing the new table's fingerprint for it; and a refusal considers every partition.
"""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import TopicPartition

from gpupipe.common.durations import format_iso_ms
from gpupipe.domain.price_schedule import fingerprint
from gpupipe_consumers.chargeback.errors import PriceChangeError
from gpupipe_consumers.chargeback.price_agreement import PriceAgreement
from gpupipe_consumers.chargeback.service import ChargebackFatalError
from gpupipe_consumers.chargeback.windows import Checkpoint, WindowEngine
from tests.unit.consumers.chargeback.test_price_rollout import (
    IN,
    NEW,
    OLD,
    G,
    Owning,
    V,
    W,
    instance,
    prices_by_window,
    records,
    run,
    split_input,
)
from tests.unit.consumers.chargeback.test_service import Broker


class FirstCommitOnly(Owning):
    """An instance that stops after its first batch (a pod restarted during the update)."""

    def consume(self, n: int, timeout: float) -> list:
        out = super().consume(n, timeout)
        self.stop.set()
        return out


def usage(recs: list[dict]) -> list[tuple]:
    drop = {"emitted_at_ms", "instance_id"}
    return sorted(tuple(sorted((k, v) for k, v in r.items() if k not in drop)) for r in recs)


def test_an_old_instance_taking_over_a_new_ones_partition_holds_and_keeps_its_table() -> None:
    log, before, fed = split_input()
    broker = Broker(before)
    run(broker, [0], OLD, "a")
    run(broker, [1], OLD, "b")
    broker.log = log  # the input crosses V while the update runs
    stop = threading.Event()
    a = instance(broker, [0], NEW, FirstCommitOnly(broker, stop, [0]), name="a")
    a.run(stop)  # a restarted with the new table: its first commit carries it, then it goes away
    assert Checkpoint.from_metadata(*broker.offsets[0]).prices == fingerprint(NEW)  # type: ignore[union-attr]
    b = run(broker, [0, 1], OLD, "b")  # b owns everything meanwhile
    assert max(r["window_start_ms"] for r in records(broker)) < V  # nothing after V billed by b
    assert b.prices_agreement.held_from == V and b.prices_agreement.other_tables() == {"0": "a"}
    cp0 = Checkpoint.from_metadata(*broker.offsets[0])
    assert cp0 is not None and (cp0.prices, cp0.writer) == (fingerprint(OLD), "b")
    assert (cp0.carried_prices, cp0.carried_writer) == (fingerprint(NEW), "a")  # still known
    run(broker, [0], NEW, "a")  # a is back (it used to be refused here: b had billed past V)
    run(broker, [1], NEW, "b")  # b updated
    run(broker, [0], NEW, "a")
    by_window = prices_by_window(broker)
    assert {w: p for w, p in by_window.items() if len(p) > 1} == {}
    assert {p for w, ps in by_window.items() for p in ps if w >= V} == {8.0}
    eng = WindowEngine(W, G, NEW, instance_id="svc")
    for s, p, o in fed:
        eng.add(s, p, o)
    assert usage(records(broker)) == usage(eng.poll_closed())  # nothing lost or doubled


def test_the_same_instance_rolled_back_takes_its_partition_back_without_holding() -> None:
    """A carried table ends when its writer restores the partition, whatever its table now."""
    log, before, _ = split_input()
    broker = Broker(before)
    run(broker, [0], OLD, "a")
    run(broker, [1], OLD, "b")
    broker.log = log
    stop = threading.Event()
    instance(broker, [0], NEW, FirstCommitOnly(broker, stop, [0]), name="a").run(stop)
    a = run(broker, [0], OLD, "a")  # the update abandoned: a has the old table again
    assert a.prices_agreement.held_from is None
    assert max(r["window_start_ms"] for r in records(broker)) >= V


def test_a_refusal_checks_every_partition_and_suggests_a_future_boundary() -> None:
    """The new instance is refused at start if any partition, not just its own, was billed past
    the change; the message names the latest horizon of all and a boundary in the future."""
    log, before, _ = split_input()
    broker = Broker(before)
    run(broker, [0], OLD)
    broker.log = log
    run(broker, [1], OLD)  # partition 1 billed past V at the old price
    with pytest.raises(ChargebackFatalError) as err:
        run(broker, [0], NEW)  # its own partition 0 was billed only up to before V
    assert isinstance(err.value.__cause__, PriceChangeError)
    billed = Checkpoint.from_metadata(*broker.offsets[1]).billed_before()  # type: ignore[union-attr]
    msg = str(err.value)
    assert (
        f"partition 1 was billed up to {format_iso_ms(billed)}" in msg and "(1 of 2 partition(s) so)" in msg
    )
    assert f"valid_from of {format_iso_ms(billed)} or later" in msg and "in the future (e.g. " in msg


def test_an_edited_base_table_is_explained() -> None:
    """Review 6(c): adding a model to the base table was refused "from 1970-01-01 on"."""
    cp = Checkpoint(0, V + 5 * W, 10, W, G, prices=fingerprint(OLD))
    agreement = PriceAgreement(((0, "other-base"),), W, G, wall=lambda: V / 1000)
    with pytest.raises(PriceChangeError) as err:
        agreement.check_restored({3: cp})
    msg = str(err.value)
    assert "1970" not in msg and "base (the prices before every change) differs" in msg
    assert "adding a model never billed" in msg
    assert f"e.g. {format_iso_ms(cp.billed_before())}" in msg  # type: ignore[arg-type]
    late = PriceAgreement(((0, "other-base"),), W, G, wall=lambda: (V + 10 * W + 1) / 1000)
    with pytest.raises(PriceChangeError, match=f"e.g. {format_iso_ms(V + 12 * W)}"):
        late.check_restored({3: cp})  # a window boundary at least a window ahead of the clock


def test_a_new_instance_taking_an_old_ones_partition_still_publishes_its_table() -> None:
    """The other way round: the carried (old) table goes beside the instance's own in its
    checkpoints, so the old instance still learns of the new table and holds too."""
    log, before, fed = split_input()
    broker = Broker(before)
    run(broker, [0, 1], OLD, "b")  # b owned everything before the update
    broker.log = log
    a = run(broker, [0], NEW, "a")  # a joins with the new table and gets partition 0
    cp0 = Checkpoint.from_metadata(*broker.offsets[0])
    assert cp0 is not None and (cp0.prices, cp0.writer) == (fingerprint(NEW), "a")
    assert (cp0.carried_prices, cp0.carried_writer) == (fingerprint(OLD), "b")
    assert a.prices_agreement.held_from == V
    old_b = run(broker, [1], OLD, "b")  # b reads a's table on partition 0: it waits as well
    assert old_b.prices_agreement.held_from == V
    assert max(r["window_start_ms"] for r in records(broker)) < V
    run(broker, [1], NEW, "b")  # b updated: its own old table carried by a is no reason to wait
    run(broker, [0], NEW, "a")  # a sees b commit the new table: the carried old one ends
    by_window = prices_by_window(broker)
    assert {w: p for w, p in by_window.items() if len(p) > 1} == {}
    assert {p for w, ps in by_window.items() for p in ps if w >= V} == {8.0}
    eng = WindowEngine(W, G, NEW, instance_id="svc")
    for s, p, o in fed:
        eng.add(s, p, o)
    assert usage(records(broker)) == usage(eng.poll_closed())


def test_a_rebalance_never_lifts_a_carried_hold_on_a_stale_read() -> None:
    """Review of 6(a): after an assignment the hold was recomputed from the last read of the
    other partitions, which did not include a carried partition just handed on (it was this
    instance's then). The hold was lifted until the next read (2 s): the old instance billed its
    kept partition past V at the old price, and the new table was refused everywhere afterwards."""
    log, before, _ = split_input()
    broker = Broker(before)
    run(broker, [0], OLD, "a")
    run(broker, [1], OLD, "b")
    broker.log = log
    stop = threading.Event()
    instance(broker, [0], NEW, FirstCommitOnly(broker, stop, [0]), name="a").run(stop)

    class HandsPartition0On(Owning):
        moved = False

        def consume(self, n: int, timeout: float) -> list:
            out = super().consume(n, timeout)
            if self.paused and not self.moved:  # b holds: partition 0 moves on (eager rebalance)
                self.moved, self.idle = True, 0
                self.on_revoke(self, [TopicPartition(IN, 0), TopicPartition(IN, 1)])
                self.on_assign(self, [TopicPartition(IN, 1)])
            return out

    stop_b = threading.Event()
    consumer = HandsPartition0On(broker, stop_b, [0, 1])
    b = instance(broker, [0, 1], OLD, consumer, name="b")
    b.prices_agreement.interval_s = 3600.0  # the others are read at start, then not for a while
    b.run(stop_b)
    assert consumer.moved and set(consumer.pos) == {1}
    assert max(r["window_start_ms"] for r in records(broker)) < V  # nothing after V billed by b
    assert b.prices_agreement.held_from == V
    cp0 = Checkpoint.from_metadata(*broker.offsets[0])
    assert cp0 is not None and (cp0.carried_prices, cp0.carried_writer) == (fingerprint(NEW), "a")
