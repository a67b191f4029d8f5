"""A partition whose GPUs stopped sending still closes its last window, and its
checkpoint moves, once it has been idle for --idle-timeout (event time advanced to broker time)."""

from __future__ import annotations

import json
import threading

from gpupipe_consumers.chargeback.service import ChargebackService
from gpupipe_consumers.chargeback.windows import WindowEngine
from tests.unit.consumers.chargeback.test_service import (
    T0,
    Broker,
    FakeConsumer,
    FakeProducer,
    comparable,
    fake_service,
    input_log,
    output,
)

H = 3_600_000


def run(broker: Broker, idle_timeout_s: float | None) -> ChargebackService:
    stop = threading.Event()
    svc = fake_service(
        lambda conf: FakeConsumer(broker, stop),
        lambda conf: FakeProducer(broker),
        batch_size=300,
        commit_records=300,
        commit_interval_s=0.0,
        idle_timeout_s=idle_timeout_s,
    )
    svc.idle.broker_now_ms = lambda: T0 + 10 * H  # type: ignore[method-assign]  # broker time went on
    svc.run(stop)
    return svc


def test_idle_partitions_close_their_last_window_and_free_the_checkpoint() -> None:
    log, fed = input_log(ticks=200)
    # Partition 1's GPUs stop after 1000 s; partition 0 goes on to 2000 s.
    cut = len(log[1]) // 2
    log[1] = log[1][:cut]
    fed = [(s, p, o) for s, p, o in fed if p == 0 or o < cut]
    eng = WindowEngine(600_000, 60_000, instance_id="svc")
    for s, p, o in fed:
        eng.add(s, p, o)
    expected = comparable(eng.flush_all())  # every window, the last ones of each partition included

    without = Broker({p: list(v) for p, v in log.items()})
    run(without, idle_timeout_s=None)
    assert output(without) != expected  # the open windows of both partitions never close

    broker = Broker(log)
    svc = run(broker, idle_timeout_s=0.0)
    assert output(broker) == expected
    for part, (offset, meta) in broker.offsets.items():  # nothing left to replay on a restart
        assert offset == json.loads(meta)["until"] == len(log[part]), part
    assert svc.engine.stats["idle_advances"] == 2
