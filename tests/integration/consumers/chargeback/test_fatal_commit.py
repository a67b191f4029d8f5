"""On a real broker: a commit that fails for good after the closed windows were drained
from the engine must not let the real consumer's close() commit checkpoints past them.

librdkafka's close() runs the (eager) revoke callback, whose normal end-of-batch commit would have
committed checkpoints without the drained windows: they were lost for good. A broker cannot fail a
commit on cue, so the service's transactional producer is a real one whose commit_transaction
raises a retriable error once, for the first transaction carrying window records, with the retry
budget at 0 (a coordinator out for longer than it). Everything else is the real client and broker.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.chargeback import service as service_mod
from gpupipe_consumers.chargeback.service import ChargebackFatalError, ChargebackService, ServiceConfig
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine, projected_sample_schema
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from tests.integration.chargeback_util import Progress, new_id, read_output, window_keys
from tests.integration.consumers.chargeback.test_environments import produce, samples

pytestmark = pytest.mark.integration


class FailingOnce:
    """A real transactional producer whose first commit of window records fails (retriable)."""

    def __init__(self, conf: dict[str, Any], output_topic: str) -> None:
        self._p = Producer(conf)
        self._out = output_topic
        self.windows_in_txn = 0
        self.failed = False

    def produce(self, topic: str, *args: Any, **kw: Any) -> None:
        if topic == self._out:
            self.windows_in_txn += 1
        self._p.produce(topic, *args, **kw)

    def commit_transaction(self, *args: Any) -> None:
        if self.windows_in_txn and not self.failed:
            self.failed = True
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "coordinator unavailable", retriable=True))
        self._p.commit_transaction(*args)
        self.windows_in_txn = 0

    def abort_transaction(self, *args: Any) -> None:
        self._p.abort_transaction(*args)
        self.windows_in_txn = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._p, name)


def service(kafka: str, prefix: str, group: str, producer_factory: Any = None) -> ChargebackService:
    proj = projected_sample_schema(catalog.current("GpuSample").raw)
    cfg = ServiceConfig(
        bootstrap=kafka,
        input_topic=prefix + topics.SAMPLES,
        output_topic=prefix + topics.CHARGEBACK,
        deadletter_topic=prefix + topics.DEADLETTER,
        group_id=group,
        instance_id="d1",
        commit_interval_s=0.2,
    )
    kw = {} if producer_factory is None else {"producer_factory": producer_factory}
    settings = ChargebackSettings(window_ms=600_000, grace_ms=60_000)
    return ChargebackService(
        cfg, build_engine(settings, None, "d1"), AvroCodec(reader_schemas={"GpuSample": proj}), **kw
    )


def test_a_fatal_commit_loses_no_window_on_a_real_broker(
    kafka: str, topic_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    produce(kafka, t_in, samples("d1", 4, 0, 200))  # windows 0-2 of 10 min close for 4 GPUs
    group = f"cb-d1-{new_id()}"
    monkeypatch.setattr(service_mod, "_RETRY_FOR_S", 0.0)
    flaky: list[FailingOnce] = []

    def failing(conf: dict[str, Any]) -> FailingOnce:
        flaky.append(FailingOnce(conf, topic_prefix + topics.CHARGEBACK))
        return flaky[-1]

    first = service(kafka, topic_prefix, group, failing)
    stop = threading.Event()
    with pytest.raises(ChargebackFatalError, match="kept failing"):
        first.run(stop)  # ends with the real consumer's close(), which runs the revoke callback
    assert flaky and flaky[0].failed and first.failed
    assert read_output(kafka, topic_prefix + topics.CHARGEBACK) == []

    prog = Progress(kafka, group, t_in)
    second = service(kafka, topic_prefix, group)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            second.run(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="chargeback-d1")
    thread.start()
    try:
        prog.wait_done(60)
    finally:
        stop.set()
        thread.join(30)
        prog.close()
    assert not thread.is_alive() and errors == []
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    keys = window_keys(out)
    assert len(keys) == len(set(keys))
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(3 * 4 * 600.0)
