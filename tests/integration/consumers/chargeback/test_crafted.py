"""Chargeback on crafted samples over a real broker: late data, splits, bad input, restart with replay.

One input topic, one partition per scenario (windows and watermarks are per partition):

* partition 0: a sample later than its window's end but within grace lands in the window; one
  after the window closed lands in a correction record for it; neither is dropped or doubled;
* partition 1: a time-sliced GPU split by per-process SM share, one split equally, two MIG slices
  (one held, one unallocated), the MIG-mode parent GPU's energy, an unallocated GPU;
* partition 2: undecodable bytes and a wrong record type (dead-lettered with headers, once), a
  missing energy counter, a counter reset, duplicated samples, an unknown GPU model, a clock that
  jumps backwards.

The service runs once to the end, is killed with SIGKILL, gets more input, restarts (replaying the
bad records and the late ones) and runs to the end again; the output must not change for the
windows already emitted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.integration.chargeback_util import (
    Progress,
    new_id,
    past_hour_ms,
    read_output,
    read_to_end,
    start_service,
    stop_service,
    totals,
    wait_log,
    window_keys,
)
from tests.synthetic_fleet import blank_sample

pytestmark = pytest.mark.integration

S = 1000
W = 600 * S  # 10-minute windows, 1-minute grace
T0 = past_hour_ms(6)
H200, UNKNOWN = "NVIDIA H200", "Acme X1"
ARGS = ("--window", "10m", "--grace", "1m", "--commit-interval", "200ms")


def alloc(ns: str, pod: str) -> dict[str, Any]:
    return {
        "namespace": ns,
        "pod": pod,
        "container": "main",
        "resource_name": "nvidia.com/gpu",
        "replica": None,
    }


def proc(ns: str, pod: str, sm: float, pid: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "process_name": "python",
        "used_memory_bytes": 2**30,
        "sm_util_ratio": sm,
        "mem_util_ratio": None,
        "namespace": ns,
        "pod": pod,
        "container": "main",
    }


def mig(uuid: str, fraction: float, gi: int) -> dict[str, Any]:
    return {
        "mig_uuid": uuid,
        "gpu_instance_id": gi,
        "compute_instance_id": 0,
        "profile": f"{round(fraction * 7)}g.71gb",
        "slice_fraction": fraction,
    }


def sample(node: str, uuid: str, k: int, *, ns: str | None = None, **kw: Any) -> dict[str, Any]:
    """Sample k (at T0 + k x 10 s) of one GPU, held by ``ns`` (None: unallocated)."""
    fields: dict[str, Any] = dict(
        timestamp_ms=T0 + k * 10 * S,
        hostname=node,
        gpu_index=0,
        uuid=uuid,
        pci_bus_id="00000000:10:00.0",
        model_name=H200,
        allocations=[alloc(ns, f"{ns}-pod")] if ns else [],
        interval_ms=10_000,
        gpu_lost=False,
        gpu_util_ratio=0.5,
        power_w=100.0,
    )
    fields.update(kw)
    return blank_sample(**fields)


def late_partition() -> Iterator[dict[str, Any]]:
    a = lambda k: sample("node-late", "GPU-late-a", k, ns="late-a")  # noqa: E731
    b = lambda k: sample("node-late", "GPU-late-b", k, ns="late-b")  # noqa: E731
    for k in range(60):
        yield a(k)
        if k < 30:
            yield b(k)
    yield from (a(k) for k in range(60, 66))  # watermark T0+650 s: window 0 still open (grace)
    yield b(30)  # late, within grace: counted in window 0
    yield from (a(k) for k in range(66, 73))  # watermark T0+720 s: window 0 closed at T0+660 s
    yield b(31)  # very late: a correction for window 0
    yield from (a(k) for k in range(73, 201))  # windows 1 and 2 close


def split_partition() -> Iterator[dict[str, Any]]:
    node = "node-split"
    for k in range(60):
        # time-sliced, per-process use 0.3 and 0.1, the idle 0.6 halved -> 0.6 and 0.4
        yield sample(
            node,
            "GPU-shared-proc",
            k,
            allocations=[alloc("ns-s1", "p1"), alloc("ns-s2", "p2")],
            processes=[proc("ns-s1", "p1", 0.3, 1), proc("ns-s2", "p2", 0.1, 2)],
        )
        # time-sliced, no per-process figures -> equal halves
        yield sample(node, "GPU-shared-equal", k, allocations=[alloc("ns-e1", "p1"), alloc("ns-e2", "p2")])
        # MIG: the parent (energy only) and two slices, one held, one free
        yield sample(node, "GPU-mig", k, mig_enabled=True, gpu_util_ratio=None, power_w=200.0)
        yield sample(
            node,
            "GPU-mig",
            k,
            ns="ns-mig",
            mig=mig("MIG-held", 3 / 7, 1),
            mig_enabled=True,
            gpu_util_ratio=None,
            sm_active_ratio=0.5,
            power_w=None,
        )
        yield sample(
            node,
            "GPU-mig",
            k,
            mig=mig("MIG-free", 4 / 7, 2),
            mig_enabled=True,
            gpu_util_ratio=None,
            sm_active_ratio=0.0,
            power_w=None,
        )
        yield sample(node, "GPU-free", k)
    yield from (sample(node, "GPU-free", k) for k in range(60, 76))  # closes window 0


def bad_partition(codec: AvroCodec) -> Iterator[dict[str, Any] | bytes]:
    node = "node-bad"
    energy = 5_000_000_000
    for k in range(60):
        yield sample(node, "GPU-no-energy", k, ns="bad-n", total_energy_mj=None)
        energy = 1_000 if k == 30 else energy + 1_000_000  # 100 W x 10 s = 1e6 mJ; reset at k=30
        yield sample(node, "GPU-reset", k, ns="bad-r", total_energy_mj=energy)
        dup = sample(node, "GPU-dup", k, ns="bad-d")
        yield dup
        yield dup
        yield sample(node, "GPU-unknown", k, ns="bad-x", model_name=UNKNOWN)
        ts_k = k if k < 40 else k - 30  # the node clock jumps back 5 minutes at k=40
        yield sample(node, "GPU-clock", ts_k, ns="bad-c")
    yield from (sample(node, "GPU-no-energy", k, ns="bad-n") for k in range(60, 76))  # closes window 0
    xid = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=1, xid_rate_per_gpu_hour=1e9)).tick(T0)[1][0]
    yield from (
        b"\xc3\x01garbage-not-avro",
        b"plain text",
        b"",
        codec.encoder("XidEvent").encode(xid),
    )
    yield from (sample(node, "GPU-no-energy", k, ns="bad-n") for k in range(76, 81))


def produce(kafka: str, topic: str, parts: dict[int, Any], codec: AvroCodec) -> None:
    enc = codec.encoder("GpuSample").encode
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "linger.ms": 20})
    for part, items in parts.items():
        for item in items:
            if isinstance(item, bytes):
                p.produce(topic, item, b"bad", partition=part, headers=[("origin", b"test")])
            else:
                key = (item["mig"]["mig_uuid"] if item["mig"] else item["uuid"]).encode()
                p.produce(topic, enc(item), key, partition=part)
    assert p.flush(30) == 0


def rows(records: list[dict], node: str, start: int = T0) -> dict[str, dict[str, float]]:
    """Totals per namespace of ``node`` in the window starting at ``start``."""
    t = totals([r for r in records if r["node"] == node], ("window_start_ms", "namespace"))
    return {ns: v for (ws, ns), v in t.items() if ws == start}


def test_late_splits_bad_input_and_restart(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    codec = AvroCodec()
    produce(kafka, t_in, {0: late_partition(), 1: split_partition(), 2: bad_partition(codec)}, codec)
    group, log = f"cb-crafted-{new_id()}", tmp_path / "chargeback.log"
    args = (*ARGS, "--group-id", group, "--instance-id", "crafted")
    prog = Progress(kafka, group, t_in)
    try:
        svc = start_service(kafka, topic_prefix, log, *args)
        prog.wait_done(60, [svc])
        svc.kill()  # SIGKILL while idle, then more input: the restart replays the open windows
        svc.wait()
        more_a = (sample("node-late", "GPU-late-a", k, ns="late-a") for k in range(201, 271))
        more_n = (sample("node-bad", "GPU-no-energy", k, ns="bad-n") for k in range(81, 201))
        produce(kafka, t_in, {0: more_a, 2: more_n}, codec)
        prog.refresh_high()
        svc = start_service(kafka, topic_prefix, log, *args)
        wait_log(log, "partitions assigned", 2)
        prog.wait_done(60, [svc])
        assert stop_service(svc) == 0, log.read_text()[-3000:]
    finally:
        prog.close()
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    keys = window_keys(out)
    assert len(keys) == len(set(keys)), "a window record was emitted twice"
    # The restart replayed partition 2 from before its bad records (offsets 376..379), so the
    # "sent once" check below means something.
    m = re.search(r"partition restored partition=2 offset=(\d+) replay_until=(\d+)", log.read_text())
    assert m and int(m.group(1)) < 376 and int(m.group(2)) == 385, m

    # -- late and very late ---------------------------------------------------------------------
    late = rows(out, "node-late")
    assert late["late-a"]["allocated_gpu_seconds"] == pytest.approx(600)
    assert late["late-b"]["allocated_gpu_seconds"] == pytest.approx(320)  # 32 samples, none lost
    b_recs = [r for r in out if r["namespace"] == "late-b"]
    assert sorted((r["kind"], r["window_start_ms"], r["sample_count"]) for r in b_recs) == [
        ("correction", T0, 1),
        ("window", T0, 31),  # 30 in time + 1 within grace
    ]
    corr = next(r for r in b_recs if r["kind"] == "correction")
    assert corr["allocated_gpu_seconds"] == pytest.approx(10)
    assert {r["window_start_ms"] for r in out if r["node"] == "node-late"} == {T0 + i * W for i in range(4)}
    assert sum(r["kind"] == "correction" for r in out) == 1

    # -- shared, MIG, unallocated ---------------------------------------------------------------
    split = rows(out, "node-split")
    alloc_s = {ns: v["allocated_gpu_seconds"] for ns, v in split.items()}
    assert alloc_s == pytest.approx(
        {
            "ns-s1": 360,
            "ns-s2": 240,
            "ns-e1": 300,
            "ns-e2": 300,
            "ns-mig": 600 * 3 / 7,
            "__unallocated__": 600 * 4 / 7 + 600,
            "__mig_shared__": 0,
        }
    )
    assert sum(alloc_s.values()) == pytest.approx(4 * 600)  # invariant: 4 physical GPUs observed
    assert split["ns-s1"]["shared_gpu_seconds"] == pytest.approx(360)
    assert split["ns-s1"]["used_gpu_seconds"] == pytest.approx(180)  # its measured 0.3 of 600 s
    assert split["ns-e2"]["shared_gpu_seconds"] == pytest.approx(300)
    assert split["ns-mig"]["mig_gpu_seconds"] == pytest.approx(600 * 3 / 7)
    assert split["ns-mig"]["used_gpu_seconds"] == pytest.approx(600 * 3 / 7 * 0.5)
    assert split["__unallocated__"]["mig_gpu_seconds"] == pytest.approx(600 * 4 / 7)
    assert split["__unallocated__"]["idle_gpu_seconds"] == pytest.approx(600 * 4 / 7)  # activity 0
    assert split["__mig_shared__"]["energy_joules"] == pytest.approx(200 * 600)

    # -- bad input ------------------------------------------------------------------------------
    bad = rows(out, "node-bad")
    for ns in ("bad-n", "bad-r", "bad-d", "bad-x", "bad-c"):
        assert bad[ns]["allocated_gpu_seconds"] == pytest.approx(600), ns
    assert bad["bad-d"]["sample_count"] == 60  # each duplicate counted once
    assert bad["bad-n"]["energy_joules"] == pytest.approx(100 * 600)  # power x time
    assert bad["bad-n"]["energy_estimated_joules"] == pytest.approx(100 * 600)
    assert bad["bad-r"]["energy_joules"] == pytest.approx(100 * 600)  # counter deltas + the reset sample
    assert bad["bad-r"]["energy_estimated_joules"] == pytest.approx(2 * 1000)  # first + reset
    assert all(v["allocated_gpu_seconds"] >= 0 and v["energy_joules"] >= 0 for v in bad.values())
    unknown = [r for r in out if r["gpu_model"] == UNKNOWN]
    assert unknown and {r["price_source"] for r in unknown} == {"default"}
    assert {r["price_source"] for r in out if r["gpu_model"] == H200} == {"exact"}
    x0 = next(r for r in unknown if r["window_start_ms"] == T0)
    assert x0["cost_allocation"] == pytest.approx(600 / 3600 * 2.50)

    dlq = read_to_end(kafka, topic_prefix + topics.DEADLETTER)
    assert len(dlq) == 4, "dead letters must be sent once, not again on replay"
    by_value = {m.value() or b"": dict(m.headers()) for m in dlq}
    assert set(by_value) >= {b"\xc3\x01garbage-not-avro", b"plain text", b""}
    reasons = {h["gpupipe.dlq.reason"].decode() for h in by_value.values()}
    assert {"not-gpupipe-avro", "empty-payload", "unexpected-record-type"} <= reasons
    for h in by_value.values():
        assert h["gpupipe.dlq.service"] == b"chargeback"
        assert h["gpupipe.dlq.topic"].decode() == t_in and h["gpupipe.dlq.partition"] == b"2"
        assert h["origin"] == b"test"  # original headers kept
