"""The derived-record sinks of alerts and recommend ride out a broker that is not there yet.

Both are the floor's :class:`gpupipe.kafka.sink.KeyedSink`: a flush that finds no broker waits for it
(the input stays uncommitted meanwhile), and the records arrive once it is back, keyed as the
service keys them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpupipe.kafka.admin import ensure_topics
from gpupipe.kafka.sink import KeyedSink
from gpupipe_consumers.alerts.handler import kafka_alert_sink
from gpupipe_consumers.recommend.service import kafka_recommendation_sink
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import wait_for
from tests.integration.drill import Broker
from tests.integration.kafka_util import read_all
from tests.unit.consumers.alerts.test_record import _records
from tests.unit.consumers.recommend.test_detector import MIN, detector, feed, sample


def _recommendation() -> dict[str, Any]:
    return feed(detector(), [sample(i * MIN, 0.01) for i in range(31)])[0]


def _alert() -> dict[str, Any]:
    return _records()[0]


CASES: dict[str, tuple[Callable[..., KeyedSink], Callable[[], dict[str, Any]], str]] = {
    "alerts": (kafka_alert_sink, _alert, "alert_id"),
    "recommend": (kafka_recommendation_sink, _recommendation, "recommendation_id"),
}


def test_a_flush_waits_for_the_broker_and_delivers_once_it_is_back(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "kafka")
    codec = AvroCodec()
    runs: dict[str, tuple[KeyedSink, dict[str, Any], str, list[BaseException | None], threading.Thread]] = {}

    def flush(sink: KeyedSink, outcome: list[BaseException | None]) -> None:
        try:
            sink.flush(0.5)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    for service, (make, record, key_field) in sorted(CASES.items()):
        sink = make(broker.bootstrap, f"sink-{service}.out", codec, {"reconnect.backoff.max.ms": "500"})
        rec = record()
        sink.send(rec)
        outcome: list[BaseException | None] = []
        flusher = threading.Thread(
            target=flush, args=(sink, outcome), name=f"test-flush-{service}", daemon=True
        )
        flusher.start()
        runs[service] = (sink, rec, key_field, outcome, flusher)
    try:
        for service, (sink, _, _, outcome, _) in runs.items():
            wait_for(
                lambda s=sink, o=outcome: s.outage_waits >= 2 or o, 30, f"{service} to wait for the broker"
            )
            assert not outcome, f"{service}: the flush gave up while the broker was away: {outcome}"
        broker.start()
        ensure_topics(broker.bootstrap, [sink.topic for sink, *_ in runs.values()])
        for service, (sink, rec, key_field, outcome, flusher) in runs.items():
            flusher.join(120)
            assert outcome == [None], service
            assert (sink.sent, sink.failed) == (1, 0), service
            (msg,) = read_all(broker.bootstrap, sink.topic, expect=1, timeout_s=30)
            assert msg.key() == rec[key_field].encode()
            assert codec.decode(msg.value()).record[key_field] == rec[key_field]
    finally:
        broker.stop()
