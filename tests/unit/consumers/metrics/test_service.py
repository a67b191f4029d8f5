"""gpupipe_consumers.metrics.service and .command without a broker: the handler's routing,
ownership of XIDs, revocation, rejections, and the command's configuration errors."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from gpupipe.commands.cli import main as cli_main
from gpupipe.common.errors import ConfigError
from gpupipe.kafka.partitioner import key_partition
from gpupipe_consumers.metrics import command
from gpupipe_consumers.metrics.service import MetricsHandler, _TimedStore
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.meaning import sample_kafka_key, xid_kafka_key
from tests.unit.consumers.metrics.test_store import blank

S, X = "gpu.samples.v1", "gpu.xid.v1"
N = 12
T_MS = 1_795_000_000_000
NOW = T_MS / 1000 + 1.0


def fleet() -> tuple[list[dict], list[dict]]:
    return SimulatedFleet(FleetConfig(nodes=2, gpus_per_node=4, xid_rate_per_gpu_hour=1e9)).tick(T_MS)


def sample_rec(r: dict, offset: int = 0, partition: int | None = None, name: str = "GpuSample") -> InRecord:
    key = sample_kafka_key(r)
    p = key_partition(key, N) if partition is None else partition
    return InRecord(S, p, offset, key, name, r, T_MS)


def xid_rec(ev: dict, key: bytes | None = None, name: str = "XidEvent") -> InRecord:
    k = key if key is not None else xid_kafka_key(ev)
    return InRecord(X, key_partition(k, 3), 0, k, name, ev, T_MS)


def handler(assigned: set[int] | None = None, **kw) -> MetricsHandler:
    h = MetricsHandler(SeriesStore(), samples_topic=S, xid_topic=X, clock=lambda: NOW, **kw)
    h.samples_partitions = N
    h.on_assign([(S, p) for p in (range(N) if assigned is None else assigned)])
    return h


def test_samples_applied_under_their_partition_and_wrong_records_rejected() -> None:
    samples, xids = fleet()
    h = handler()
    recs = [sample_rec(r, i) for i, r in enumerate(samples)]
    wrong = InRecord(S, 0, 99, b"k", "XidEvent", xids[0], T_MS)
    broken = InRecord(S, 1, 100, b"k2", "GpuSample", {"hostname": "n"}, T_MS)
    rejected = h.handle([*recs, wrong, broken])
    assert [(r.offset, reason) for r, reason, _ in rejected] == [
        (99, "unexpected-record-type"),
        (100, "invalid-record"),
    ]
    assert h.store.gpu_count() == len(samples)
    for rec in recs:
        assert h.store.partition_of(rec.value["uuid"]) == (S, rec.partition)
    assert h.murmur_ok


def test_old_samples_are_skipped_and_counted() -> None:
    samples, _ = fleet()
    h = handler(max_sample_age_s=60.0)
    old = {**samples[0], "timestamp_ms": T_MS - 120_000}
    assert h.handle([sample_rec(old), sample_rec(samples[1])]) == []
    assert h.store.keys() == [samples[1]["uuid"]] and h.skipped_old == 1
    h_off = handler(max_sample_age_s=None)
    h_off.handle([sample_rec(old)])
    assert h_off.store.gpu_count() == 1


def test_revoke_drops_series_at_once() -> None:
    samples, _ = fleet()
    h = handler()
    recs = [sample_rec(r) for r in samples]
    h.handle(recs)
    gone = {recs[0].partition}
    h.on_revoke([(S, p) for p in gone])
    assert gone.isdisjoint(h.assigned)
    left = {r.value["uuid"] for r in recs if r.partition not in gone}
    assert set(h.store.keys()) == left
    assert recs[0].value["uuid"].encode() not in h.store.render(NOW)


def test_xids_follow_sample_ownership() -> None:
    samples, xids = fleet()
    mine = {r["uuid"] for r in samples[:4]}
    parts = {key_partition(u.encode(), N) for u in mine}
    h = handler(assigned=parts)
    h.handle([sample_rec(r) for r in samples if key_partition(r["uuid"].encode(), N) in parts])
    by_uuid = {ev["uuid"]: ev for ev in xids}
    events = [xid_rec({**by_uuid[r["uuid"]], "event_id": f"e{i}"}) for i, r in enumerate(samples)]
    assert h.handle_xids(events) == []
    owned = [e for e in events if key_partition(e.key, N) in parts]
    assert h.xid_results["applied"] == len(owned)
    assert h.xid_results["other_owner"] == len(events) - len(owned)
    text = h.store.render(NOW).decode()
    for e in events:
        shown = f'UUID="{e.value["uuid"]}"' in text
        assert shown == (e in owned), e.value["uuid"]

    # an event for a GPU not sampled yet, whose key hashes to a held partition: kept under it
    new_key = next(f"GPU-new-{i}" for i in range(1000) if key_partition(f"GPU-new-{i}".encode(), N) in parts)
    ev = {**xids[0], "uuid": new_key, "mig_uuid": None, "event_id": "new"}
    assert h.handle_xids([xid_rec(ev)]) == []
    p = key_partition(new_key.encode(), N)
    assert h.store.keys().count(new_key) == 1

    # revocation takes the XID counters along, and a late event does not bring the GPU back
    h.on_revoke([(S, p)])
    assert new_key not in set(h.store.keys())
    h.handle_xids([xid_rec({**ev, "event_id": "late"})])
    assert new_key not in set(h.store.keys())


def test_wrong_record_on_xid_topic_rejected_only_by_its_owner() -> None:
    samples, _ = fleet()
    key = samples[0]["uuid"].encode()
    p = key_partition(key, N)
    owner, other = handler(assigned={p}), handler(assigned=set(range(N)) - {p})
    rec = InRecord(X, 0, 5, key, "GpuSample", samples[0], T_MS)
    assert [reason for _, reason, _ in owner.handle_xids([rec])] == ["unexpected-record-type"]
    assert other.handle_xids([rec]) == []


def test_keys_not_murmur2_partitioned_disable_hash_ownership() -> None:
    samples, xids = fleet()
    h = handler()
    r = samples[0]
    wrong_p = (key_partition(r["uuid"].encode(), N) + 1) % N
    h.handle([sample_rec(r, partition=wrong_p)])
    assert not h.murmur_ok
    # a GPU already held still gets its XIDs; an unknown one is left to... nobody can tell
    assert h.handle_xids([xid_rec({**xids[0], "uuid": r["uuid"], "event_id": "a"})]) == []
    assert h.xid_results["applied"] == 1
    h.handle_xids([xid_rec({**xids[0], "uuid": "GPU-unknown", "event_id": "b"})])
    assert "GPU-unknown" not in set(h.store.keys())
    # a bad record on the XID topic is still dead-lettered by exactly one owner
    wrong = InRecord(X, 0, 5, b"some-key", "GpuSample", r, T_MS)
    assert [reason for _, reason, _ in h.handle_xids([wrong])] == ["unexpected-record-type"]


# -- the command ------------------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    from gpupipe.commands.cli import add_common

    add_common(p)
    return p.parse_args(list(argv))


def test_defaults() -> None:
    cfg = command.config_from_args(parse())
    assert (cfg.host, cfg.port, cfg.group_id, cfg.host_label) == (
        "",  # every address, IPv4 and IPv6, as dcgm-exporter's ":9400"
        9400,
        "gpupipe-metrics",
        "Hostname",
    )
    assert cfg.stale_after_s is None and cfg.stale_intervals == 3.0 and cfg.max_sample_age_s == 300.0
    assert cfg.split_shared and cfg.web_config is None and not cfg.from_beginning
    cfg = command.config_from_args(
        parse("--host-label", "none", "--stale-after", "90s", "--max-sample-age", "0", "--listen", ":9500")
    )
    assert cfg.host_label is None and cfg.stale_after_s == 90.0 and cfg.max_sample_age_s is None
    assert (cfg.host, cfg.port) == ("", 9500)  # Go's ":9500": every address, dual-stack


@pytest.mark.parametrize(
    "argv",
    [
        ["--listen", "nowhere"],
        ["--stale-after", "0s"],
        ["--stale-intervals", "0"],
        ["--collectors", "/nonexistent/counters.csv"],
        ["--web-config-file", "/nonexistent/web.yml"],
    ],
)
def test_config_errors_exit_2_before_any_broker(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["metrics", "--bootstrap-servers", "127.0.0.1:1", *argv])
    assert rc == 2, capsys.readouterr().err
    assert "error" in capsys.readouterr().err


def test_bad_counters_csv_lists_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "counters.csv"
    bad.write_text("DCGM_FI_DEV_GPU_TEMP, gauge, t\nGPU_TEMP_TYPO, gauge, nope\n")
    with pytest.raises(ConfigError, match="GPU_TEMP_TYPO"):
        command.config_from_args(parse("--collectors", str(bad)))


def test_ingest_delay_is_observed_per_batch_from_the_oldest_record() -> None:
    from prometheus_client import CollectorRegistry

    from gpupipe_consumers.metrics.service import ServiceMetrics

    samples, _ = fleet()
    reg = CollectorRegistry()
    h = handler(metrics=ServiceMetrics(reg))
    recs = [sample_rec(r, i) for i, r in enumerate(samples)]  # published at T_MS, applied at NOW = +1 s
    h.handle(recs)
    name = "gpupipe_metrics_ingest_delay_seconds"
    assert reg.get_sample_value(f"{name}_count") == 1.0
    assert reg.get_sample_value(f"{name}_sum") == pytest.approx(1.0)
    assert reg.get_sample_value(f"{name}_bucket", {"le": "0.75"}) == 0.0
    assert reg.get_sample_value(f"{name}_bucket", {"le": "1.0"}) == 1.0


def test_the_service_process_tunes_the_cyclic_gc() -> None:
    """Young and full collections were a quarter of the service's CPU at 10k samples/s."""
    import gc

    from gpupipe_consumers.metrics import gcpolicy
    from gpupipe_consumers.metrics.service import GC_THRESHOLDS, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    finally:
        gcpolicy.reset(before)


def test_a_scrape_freezes_each_chunk_of_gpus_as_it_renders_them() -> None:
    """A scrape of more GPUs than a young generation holds (from about 25k GPUs per instance at the
    service's threshold of 50k containers) ran young collections inside it that walked the GPUs
    rendered so far (9-13 us per GPU at 50k GPUs, 0 at 10k). The store alone (no final freeze of
    the service's) now leaves no rendered GPU's lines to the collector."""
    import gc

    from gpupipe_consumers.metrics import gcpolicy

    store = SeriesStore(flush_chunk=16)
    now = time.time()
    for i in range(100):
        store.apply_sample(blank(f"GPU-{i}", gpu_index=i % 8, hostname=f"n{i // 8}"), 0, now)
    before = gc.get_threshold()
    try:
        gcpolicy.tune_gc()
        store.render_parts(now)
        rendered = {id(g.lines) for g in store._gpus.values()}
        assert len(rendered) == 100
        assert not rendered & {id(o) for o in gc.get_objects()}  # every one frozen
    finally:
        gcpolicy.reset(before)


def test_a_scrape_freezes_what_it_leaves_and_a_full_collection_follows_in_time() -> None:
    """The line lists a scrape leaves are frozen, so the next young collection does not walk them
    (200 ms pauses at 20k GPUs before); a cycle frozen alive and dropped later is collected by the
    periodic full collection."""
    import gc
    import weakref

    from gpupipe_consumers.metrics import gcpolicy

    class Node:
        pass

    store = _TimedStore(stale_after_s=3600)
    before = gc.get_threshold()
    try:
        gcpolicy.tune_gc()
        store.apply_sample(blank("GPU-0"), 0, time.time())
        frozen = gc.get_freeze_count()
        store.render_parts()  # the service's store: freezes after the scrape
        assert gc.get_freeze_count() > frozen
        assert all(o is not store._gpus["GPU-0"].lines for o in gc.get_objects(0))  # not young
        cycle = Node()
        cycle.me = cycle  # type: ignore[attr-defined]
        ref = weakref.ref(cycle)
        gcpolicy.after_scrape()  # frozen while alive
        del cycle
        gc.collect()
        assert ref() is not None  # frozen garbage: not collected ...
        gcpolicy.after_scrape(clock=time.monotonic() + gcpolicy.FULL_COLLECT_S + 1)
        assert ref() is None  # ... until the periodic full collection
    finally:
        gcpolicy.reset(before)


def test_xid_reader_retries_a_failed_metadata_refresh_at_once() -> None:
    """A fresh topic answers NOT_LEADER for a moment: the reader must not wait a whole refresh
    period (30 s by default) before it reads any XID."""
    import threading
    from types import SimpleNamespace

    from confluent_kafka import KafkaError, KafkaException

    from gpupipe_consumers.metrics.service import MetricsHandler, XidReader
    from gpupipe_consumers.metrics.store import SeriesStore
    from gpupipe_schemas.codec import AvroCodec

    assigned = threading.Event()

    class _Consumer:
        calls = 0

        def list_topics(self, timeout: float) -> SimpleNamespace:
            _Consumer.calls += 1
            if _Consumer.calls == 1:
                raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
            topic = SimpleNamespace(error=None, partitions={0: None})
            return SimpleNamespace(topics={"gpu.xid.v1": topic, "gpu.samples.v1": topic})

        def incremental_assign(self, parts: list) -> None:
            assigned.set()

        def consume(self, n: int, timeout: float) -> list:
            return []

        def get_watermark_offsets(self, tp: object, cached: bool = False) -> tuple[int, int]:
            return (0, 0)

        def close(self) -> None:
            pass

    handler = MetricsHandler(SeriesStore(), samples_topic="gpu.samples.v1", xid_topic="gpu.xid.v1")
    reader = XidReader(
        bootstrap="unused:9092",
        topic="gpu.xid.v1",
        samples_topic="gpu.samples.v1",
        handler=handler,
        codec=AvroCodec(),
        loop=SimpleNamespace(metrics=None),  # type: ignore[arg-type]
        from_beginning=True,
        metadata_refresh_s=3600.0,
        consumer_factory=lambda _cfg: _Consumer(),
    )
    stop = threading.Event()
    t = threading.Thread(target=reader.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert assigned.wait(30), "the XID partitions were never assigned after one failed refresh"
    finally:
        stop.set()
        t.join(10)
    assert _Consumer.calls == 2
