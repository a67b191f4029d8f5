"""A rolling update of a price change never bills one window at two prices.

During the update old instances (old price file) and new ones (file with the change) run side by
side, each owning some partitions. An old instance does not know of the change: had it emitted the
windows after ``valid_from`` with its old price while a new one emitted them with the new one, the
same hour would be billed twice over at two prices. Each checkpoint carries its instance's price
fingerprint; an instance never closes a window from the point where another partition's prices
differ until they agree, and refuses a partition already billed with other prices. Against the
in-memory broker of ``test_chargeback_service`` (one instance per partition, run in turn).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import yaml
from confluent_kafka import TopicPartition

from gpupipe.domain.price_schedule import PriceSchedule, divergence, fingerprint, parse_price_schedule
from gpupipe_consumers.chargeback.errors import PriceChangeError
from gpupipe_consumers.chargeback.service import ChargebackFatalError, ChargebackService
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_schemas.codec import AvroCodec
from tests.unit.consumers.chargeback.test_service import (
    IN,
    OUT,
    T0,
    Broker,
    FakeConsumer,
    FakeProducer,
    comparable,
    fake_service,
    input_log,
)

W, G = 600_000, 60_000
V = T0 - T0 % W + 4 * W  # the change: the start of the 5th window, about 33 minutes into the input
OLD_DOC = "currency: USD\nenergy_per_kwh: 0.1\nmodels: [{match: '*', per_gpu_hour: 4.0}]\n"
NEW_DOC = OLD_DOC + f"changes: [{{valid_from: {V // 1000}, models: [{{match: '*', per_gpu_hour: 8.0}}]}}]\n"


def schedule(doc: str) -> PriceSchedule:
    data = yaml.safe_load(doc)
    for change in data.get("changes", []):  # epoch seconds -> ISO (the file's format)
        from gpupipe.common.durations import format_iso_ms

        change["valid_from"] = format_iso_ms(int(change["valid_from"]) * 1000)
    return parse_price_schedule(data, "test")


OLD, NEW = schedule(OLD_DOC), schedule(NEW_DOC)


class Owning(FakeConsumer):
    """Owns only ``parts`` of the input, as one of two instances of a group."""

    def __init__(self, broker: Broker, stop: threading.Event, parts: list[int]) -> None:
        super().__init__(broker, stop)
        self.parts = parts

    def consume(self, n: int, timeout: float) -> list:
        if self.pending_assign:
            self.pending_assign = False
            self.on_assign(self, [TopicPartition(IN, p) for p in self.parts])
        self.pending_assign = False
        return super().consume(n, timeout)


def instance(
    broker: Broker, parts: list[int], prices: PriceSchedule, consumer: Any = None, name: str = "svc"
) -> ChargebackService:
    stop = threading.Event()
    svc = fake_service(
        lambda conf: consumer or Owning(broker, stop, parts),
        lambda conf: FakeProducer(broker),
        build_engine(ChargebackSettings(window_ms=W, grace_ms=G), prices, name),
        batch_size=100,
        commit_records=100,
        commit_interval_s=0.0,
    )
    svc.prices_agreement.interval_s = 0.0  # check the other partitions' prices every loop
    svc._stop_event = stop  # type: ignore[attr-defined]
    return svc


def run(broker: Broker, parts: list[int], prices: PriceSchedule, name: str = "svc") -> ChargebackService:
    svc = instance(broker, parts, prices, name=name)
    svc.run(svc._stop_event)  # type: ignore[attr-defined]
    return svc


def records(broker: Broker) -> list[dict]:
    codec = AvroCodec()
    return [codec.decode(v).record for t, v in broker.output if t == OUT]


def prices_by_window(broker: Broker) -> dict[int, set[float]]:
    out: dict[int, set[float]] = {}
    for r in records(broker):
        out.setdefault(r["window_start_ms"], set()).add(r["price_per_gpu_hour"])
    return out


def split_input() -> tuple[dict[int, list], dict[int, list], list[tuple[dict, int, int]]]:
    """The whole input, and the part of it sent before the update (ending 10 minutes before V)."""
    log, fed = input_log(ticks=400)
    before = {p: [e for e in v if e[1] < V - W] for p, v in log.items()}
    return log, before, fed


def expected(fed: list[tuple[dict, int, int]], prices: PriceSchedule) -> list[tuple]:
    eng = WindowEngine(W, G, prices, instance_id="svc")
    for s, p, o in fed:
        eng.add(s, p, o)
    return comparable(eng.poll_closed())


def test_the_fingerprints_differ_from_the_change_on() -> None:
    assert divergence(fingerprint(OLD), fingerprint(NEW)) == V
    assert divergence(fingerprint(NEW), fingerprint(NEW)) is None


def test_a_rolling_update_bills_every_window_at_one_price() -> None:
    log, before, fed = split_input()
    broker = Broker(before)
    run(broker, [0], OLD)  # before the update: old instances a (partition 0) and b (partition 1)
    run(broker, [1], OLD)
    broker.log = log  # input goes on, across V, while the update replaces a, then b
    new_a = run(broker, [0], NEW)  # b still prices the old way: a waits at V
    old_b = run(broker, [1], OLD)  # a's checkpoint tells b of the change: b waits at V
    during = [r["window_start_ms"] for r in records(broker)]
    run(broker, [1], NEW)  # b replaced: every instance prices alike
    run(broker, [0], NEW)  # a goes on
    by_window = prices_by_window(broker)
    assert {w: p for w, p in by_window.items() if len(p) > 1} == {}, "a window with two prices"
    assert {p for w, ps in by_window.items() for p in ps if w >= V} == {8.0}
    assert {p for w, ps in by_window.items() for p in ps if w < V} == {4.0}
    assert comparable(records(broker)) == expected(fed, NEW)  # nothing lost or doubled by waiting
    assert max(during) < V  # nothing after the change was billed while the update ran
    assert new_a.prices_agreement.held_from == old_b.prices_agreement.held_from == V
    assert old_b.registry.get_sample_value("gpupipe_chargeback_price_hold_from_seconds") == V / 1000


def test_without_the_agreement_the_old_instance_would_bill_the_hour_at_its_price() -> None:
    """What happened before: the old instance priced the windows after V at 4.0, the new one 8.0."""
    log, before, _ = split_input()
    broker = Broker(before)
    run(broker, [0], OLD)
    run(broker, [1], OLD)
    broker.log = log
    new_a = instance(broker, [0], NEW)
    new_a.prices_agreement.update = lambda others, lift=True: False  # type: ignore[method-assign]
    new_a.run(new_a._stop_event)  # type: ignore[attr-defined]
    old_b = instance(broker, [1], OLD)
    old_b.prices_agreement.update = lambda others, lift=True: False  # type: ignore[method-assign]
    old_b.holds.check_group_prices = lambda: None  # type: ignore[method-assign]  # nor the start check
    old_b.run(old_b._stop_event)  # type: ignore[attr-defined]
    assert {w for w, p in prices_by_window(broker).items() if p == {4.0, 8.0}}


class Agreeing(Owning):
    """After the instance has waited a while, the other partition's checkpoint shows the new prices
    (the other instance was updated meanwhile): the held records go on in the same process."""

    waited = 0

    def consume(self, n: int, timeout: float) -> list:
        out = super().consume(n, timeout)
        if self.paused:
            self.waited += 1
            self.idle = 0
            if self.waited == 3:
                off, meta = self.b.offsets[1]
                data = json.loads(meta)
                data["px"] = [list(e) for e in fingerprint(NEW)]
                self.b.offsets[1] = (off, json.dumps(data))
        return out


def test_held_records_go_on_when_the_instances_agree() -> None:
    log, before, fed = split_input()
    broker = Broker(before)
    run(broker, [0], OLD)
    run(broker, [1], OLD)
    broker.log = log
    consumer = Agreeing(broker, threading.Event(), [0])
    svc = instance(broker, [0], NEW, consumer)
    consumer.stop = svc._stop_event  # type: ignore[attr-defined]
    svc.run(svc._stop_event)  # type: ignore[attr-defined]
    assert consumer.waited >= 3 and not consumer.paused and svc.held == {}
    ours = [r for r in records(broker) if r["source_partition"] == 0]
    assert max(r["window_start_ms"] for r in ours) >= V
    want = [r for r in expected(fed, NEW) if dict(r)["source_partition"] == 0]
    assert comparable(ours) == want


def test_a_change_for_usage_already_billed_is_refused() -> None:
    """Deployed after the windows after V were billed at the old price: never re-price them (their
    corrections would carry the new price), refuse to start with the table instead."""
    log, _, _ = split_input()
    broker = Broker(log)
    run(broker, [0], OLD)
    with pytest.raises(ChargebackFatalError) as err:
        run(broker, [0], NEW)
    assert isinstance(err.value.__cause__, PriceChangeError)
    assert "valid_from of" in str(err.value) and "billed up to" in str(err.value)
