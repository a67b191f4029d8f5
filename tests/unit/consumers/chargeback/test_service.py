"""The transactional loop's error paths against an in-memory broker: abort + rewind, retry, fatal, lost.

A real broker cannot be made to fail a commit on cue; these fakes can. The committed output must
stay exactly the engine's output on the whole input: no window lost, none twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from gpupipe_consumers.chargeback.service import ChargebackFatalError, ChargebackService, ServiceConfig
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine, projected_sample_schema
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

T0 = 1_795_000_000_000
IN, OUT, DLQ = "in", "out", "dlq"


class Msg:
    def __init__(self, partition: int, offset: int, value: bytes | None, ts: int) -> None:
        self._p, self._o, self._v, self._ts = partition, offset, value, ts

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def value(self) -> bytes | None:
        return self._v

    def key(self) -> bytes:
        return b"k"

    def topic(self) -> str:
        return IN

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)


class Broker:
    """Input log, committed group offsets (with metadata) and committed output, transactionally."""

    def __init__(self, log: dict[int, list[tuple[bytes | None, int]]]) -> None:
        self.log = log
        self.offsets: dict[int, tuple[int, str]] = {}
        self.output: list[tuple[str, bytes | None]] = []
        self.fail: list[KafkaError] = []  # errors commit_transaction raises next, in order


class FakeConsumer:
    def __init__(self, broker: Broker, stop: threading.Event) -> None:
        self.b, self.stop = broker, stop
        self.pos: dict[int, int] = {}
        self.paused: set[int] = set()
        self.idle = 0

    def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any, on_lost: Any) -> None:
        self.on_assign, self.on_revoke, self.on_lost = on_assign, on_revoke, on_lost
        self.pending_assign = True

    def consume(self, n: int, timeout: float) -> list[Msg]:
        if self.pending_assign:
            self.pending_assign = False
            self.on_assign(self, [TopicPartition(IN, p) for p in sorted(self.b.log)])
        out: list[Msg] = []
        for p, pos in sorted(self.pos.items()):
            if p in self.paused:
                continue
            for off in range(pos, min(len(self.b.log[p]), pos + n - len(out))):
                value, ts = self.b.log[p][off]
                out.append(Msg(p, off, value, ts))
                self.pos[p] = off + 1
        if not out:
            self.idle += 1
            if self.idle > 3:
                self.stop.set()
        return out

    def assign(self, tps: list[TopicPartition]) -> None:
        self.pos = {tp.partition: tp.offset for tp in tps}

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        """The service asks before each commit whether the broker answers (it always does here)."""
        return SimpleNamespace(topics={IN: SimpleNamespace(partitions=dict.fromkeys(self.b.log), error=None)})

    def seek(self, tp: TopicPartition) -> None:
        self.pos[tp.partition] = tp.offset

    def pause(self, tps: list[TopicPartition]) -> None:
        """Paused partitions deliver nothing until resumed (their position is kept)."""
        self.paused |= {tp.partition for tp in tps}

    def resume(self, tps: list[TopicPartition]) -> None:
        self.paused -= {tp.partition for tp in tps}

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        out = []
        for tp in tps:
            off, meta = self.b.offsets.get(tp.partition, (-1001, None))
            out.append(
                TopicPartition(IN, tp.partition, off, meta) if meta else TopicPartition(IN, tp.partition, off)
            )
        return out

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float = 0, cached: bool = False) -> tuple:
        return 0, len(self.b.log[tp.partition])

    def consumer_group_metadata(self) -> str:
        return "group-meta"

    def close(self) -> None:
        self.on_revoke(self, [TopicPartition(IN, p) for p in sorted(self.pos)])


class FakeProducer:
    def __init__(self, broker: Broker) -> None:
        self.b = broker
        self.staged: list[tuple[str, bytes | None]] = []
        self.staged_offsets: list[TopicPartition] = []
        self.in_txn = False
        self.commits = self.aborts = 0

    def init_transactions(self, timeout: float) -> None:
        pass

    def begin_transaction(self) -> None:
        assert not self.in_txn
        self.in_txn = True

    def produce(self, topic: str, value: bytes | None, key: bytes | None, headers: Any = None) -> None:
        assert self.in_txn
        self.staged.append((topic, value))

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], meta: Any, timeout: float) -> None:
        assert self.in_txn and meta == "group-meta"
        self.staged_offsets += offsets

    def commit_transaction(self, timeout: float) -> None:
        assert self.in_txn
        if self.b.fail:
            raise KafkaException(self.b.fail.pop(0))
        self.b.output += self.staged
        for tp in self.staged_offsets:
            self.b.offsets[tp.partition] = (tp.offset, tp.metadata)
        self.staged, self.staged_offsets, self.in_txn = [], [], False
        self.commits += 1

    def abort_transaction(self, timeout: float) -> None:
        self.staged, self.staged_offsets, self.in_txn = [], [], False
        self.aborts += 1

    def poll(self, timeout: float) -> int:
        return 0


def input_log(parts: int = 2, ticks: int = 400) -> tuple[dict[int, list], list[tuple[dict, int, int]]]:
    fleet = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=4, interval_ms=10_000, seed=6))
    enc = AvroCodec().encoder("GpuSample").encode
    log: dict[int, list] = {p: [] for p in range(parts)}
    fed = []
    for k in range(ticks):
        for i, s in enumerate(fleet.tick(T0 + k * 10_000)[0]):
            p = i % parts
            fed.append((s, p, len(log[p])))
            log[p].append((enc(s), T0 + k * 10_000))
    log[0].insert(37, (b"garbage", T0))  # an undecodable record: one dead letter, ever
    fed = [(s, p, o + (1 if p == 0 and o >= 37 else 0)) for s, p, o in fed]
    return log, fed


def comparable(records: list[dict]) -> list[tuple]:
    """Records without emitted_at_ms (the watermark at commit time, which batching moves)."""
    return sorted(tuple(sorted((k, v) for k, v in r.items() if k != "emitted_at_ms")) for r in records)


def expected_output(fed: list[tuple[dict, int, int]]) -> list[tuple]:
    eng = WindowEngine(600_000, 60_000, instance_id="svc")
    for s, p, o in fed:
        eng.add(s, p, o)
    return comparable(eng.poll_closed())


def output(broker: Broker) -> list[tuple]:
    codec = AvroCodec()
    return comparable([codec.decode(v).record for t, v in broker.output if t == OUT])


def fake_service(
    consumer: Callable[[dict], Any],
    producer: Callable[[dict], Any],
    engine: WindowEngine | None = None,
    **cfg: Any,
) -> ChargebackService:
    """A service on the fake topics IN/OUT/DLQ with the given client factories and ServiceConfig
    fields; by default an engine of 10 m windows, 1 m grace and no prices."""
    proj = projected_sample_schema(catalog.current("GpuSample").raw)
    return ChargebackService(
        ServiceConfig(bootstrap="fake", input_topic=IN, output_topic=OUT, deadletter_topic=DLQ, **cfg),
        engine or build_engine(ChargebackSettings(window_ms=600_000, grace_ms=60_000), None, "svc"),  # type: ignore[arg-type]
        AvroCodec(reader_schemas={"GpuSample": proj}),
        consumer_factory=consumer,
        producer_factory=producer,
    )


def run_service(broker: Broker, **cfg: Any) -> tuple[ChargebackService, FakeProducer]:
    stop = threading.Event()
    prod = FakeProducer(broker)
    svc = fake_service(lambda conf: FakeConsumer(broker, stop), lambda conf: prod, **cfg)
    svc.run(stop)
    return svc, prod


def test_clean_run_commits_every_closed_window_once() -> None:
    log, fed = input_log()
    broker = Broker(log)
    _, prod = run_service(broker, batch_size=300, commit_records=300, commit_interval_s=0.0)
    assert output(broker) == expected_output(fed)
    assert [v for t, v in broker.output if t == DLQ] == [b"garbage"]
    assert prod.commits > 5 and prod.aborts == 0


@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_aborted_transaction_rewinds_to_the_checkpoints(fail_at: int) -> None:
    log, fed = input_log()
    broker = Broker(log)
    abortable = KafkaError(KafkaError._STATE, "test abort", txn_requires_abort=True)
    retriable = KafkaError(KafkaError._TIMED_OUT, "test retry", retriable=True)
    # Fail commit number `fail_at` (abort), then one retriable error (retried in place).
    broker.fail = []
    calls = {"n": 0}
    real_commit = FakeProducer.commit_transaction

    def commit(self: FakeProducer, timeout: float) -> None:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise KafkaException(abortable)
        if calls["n"] == fail_at + 3:
            raise KafkaException(retriable)
        real_commit(self, timeout)

    FakeProducer.commit_transaction = commit  # type: ignore[method-assign]
    try:
        svc, prod = run_service(broker, batch_size=300, commit_records=300, commit_interval_s=0.0)
    finally:
        FakeProducer.commit_transaction = real_commit  # type: ignore[method-assign]
    assert prod.aborts == 1
    assert svc.metrics.transactions.labels("aborted")._value.get() == 1
    assert output(broker) == expected_output(fed)
    assert [v for t, v in broker.output if t == DLQ] == [b"garbage"]


def test_fatal_error_ends_the_service() -> None:
    log, _ = input_log(ticks=50)
    broker = Broker(log)
    broker.fail = [KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)]
    with pytest.raises(ChargebackFatalError, match="fenced"):
        run_service(broker, batch_size=100, commit_records=100, commit_interval_s=0.0)
    assert broker.output == []


def test_restart_from_committed_checkpoints_continues_exactly() -> None:
    log, fed = input_log()
    full = {p: list(v) for p, v in log.items()}
    half = {p: v[: len(v) // 2] for p, v in log.items()}
    broker = Broker(half)
    run_service(broker, batch_size=250, commit_records=250, commit_interval_s=0.0)
    assert broker.offsets  # checkpoints committed with metadata
    assert all(meta and '"until"' in meta for _, meta in broker.offsets.values())
    broker.log = full  # more input arrives; a new process restores and replays
    run_service(broker, batch_size=250, commit_records=250, commit_interval_s=0.0)
    assert output(broker) == expected_output(fed)
    assert [v for t, v in broker.output if t == DLQ] == [b"garbage"]


def test_building_the_service_creates_no_kafka_client() -> None:
    """Config errors come before any network: the clients are made when the service runs."""
    log, _ = input_log(ticks=10)
    broker = Broker(log)
    stop = threading.Event()
    made: list[str] = []

    def consumer(conf: dict) -> FakeConsumer:
        made.append("consumer")
        return FakeConsumer(broker, stop)

    def producer(conf: dict) -> FakeProducer:
        made.append("producer")
        return FakeProducer(broker)

    def admin(conf: dict) -> Any:
        made.append("admin")
        return SimpleNamespace(alter_consumer_group_offsets=lambda reqs: {})

    proj = projected_sample_schema(catalog.current("GpuSample").raw)
    svc = ChargebackService(
        ServiceConfig(bootstrap="fake", input_topic=IN, output_topic=OUT, deadletter_topic=DLQ),
        build_engine(ChargebackSettings(window_ms=600_000, grace_ms=60_000), None, "svc"),  # type: ignore[arg-type]
        AvroCodec(reader_schemas={"GpuSample": proj}),
        consumer_factory=consumer,
        producer_factory=producer,
        admin_factory=admin,
    )
    assert made == []
    svc.run(stop)
    assert sorted(made) == ["admin", "consumer", "producer"]


def test_samples_of_gpus_past_max_gpus_are_dead_lettered_with_a_counted_reason() -> None:
    """The GPU bound never drops billable data silently."""
    fleet = SimulatedFleet(FleetConfig(nodes=10, gpus_per_node=3, interval_ms=10_000, seed=6))
    enc = AvroCodec().encoder("GpuSample").encode
    broker = Broker({0: [(enc(s), T0) for s in fleet.tick(T0)[0]]})
    stop = threading.Event()
    engine = build_engine(ChargebackSettings(window_ms=600_000, grace_ms=60_000, max_gpus=10), None, "svc")  # type: ignore[arg-type]
    svc = fake_service(lambda conf: FakeConsumer(broker, stop), lambda conf: FakeProducer(broker), engine)
    svc.run(stop)
    assert len([v for t, v in broker.output if t == DLQ]) == 20
    assert svc.metrics.dead_letters.labels("gpu-cap")._value.get() == 20
