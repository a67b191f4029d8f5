"""Records any node may write that once stopped chargeback for good or poisoned a bill.

A real broker and ``gpupipe chargeback`` in a subprocess: a sample dated -2**63 (its window would not
encode), NaN, infinite and 1e300 power without an energy counter, a NaN MIG fraction, a value over
librdkafka's message limit and a small value with a 1 MB header, between good samples. The service
keeps running, bills the good samples exactly, dead-letters each hostile record once (cut to fit),
and no cost is non-finite.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_schemas.codec import AvroCodec
from tests.integration.chargeback_util import (
    Progress,
    kill_left,
    new_id,
    past_hour_ms,
    read_output,
    read_to_end,
    start_service,
    stop_service,
)
from tests.synthetic_fleet import blank_sample

pytestmark = pytest.mark.integration

T0 = past_hour_ms(3)
S = 1000
ARGS = ("--window", "10m", "--grace", "1m", "--commit-interval", "200ms")


def sample(ns: str, k: int, **kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        timestamp_ms=T0 + k * 10 * S,
        hostname="node-p",
        gpu_index=0,
        uuid=f"GPU-{ns}",
        pci_bus_id="00000000:10:00.0",
        model_name="NVIDIA H200",
        allocations=[
            {
                "namespace": ns,
                "pod": f"{ns}-pod",
                "container": "main",
                "resource_name": "nvidia.com/gpu",
                "replica": None,
            }
        ],
        interval_ms=10_000,
        gpu_lost=False,
        gpu_util_ratio=0.5,
        power_w=100.0,
    )
    fields.update(kw)
    return blank_sample(**fields)


def test_hostile_samples_are_dead_lettered_and_the_good_ones_billed(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    enc = AvroCodec().encoder("GpuSample").encode
    hostile = {
        "ts-min": sample("poison", 5, timestamp_ms=-(2**63)),
        "power-nan": sample("nan-ns", 5, power_w=float("nan")),
        "power-inf": sample("inf-ns", 5, power_w=float("inf")),
        "power-huge": sample("huge-ns", 5, power_w=1e300),
        "mig-nan": sample(
            "mignan-ns",
            5,
            mig={
                "mig_uuid": "MIG-x",
                "gpu_instance_id": 1,
                "compute_instance_id": 0,
                "profile": "1g.18gb",
                "slice_fraction": float("nan"),
            },
        ),
    }
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "message.max.bytes": 2_000_000})
    for k in range(60):  # 10 minutes of one good GPU, the hostile records among them
        p.produce(t_in, enc(sample("good-ns", k)), b"GPU-good-ns", partition=0)
        if k == 10:
            for name, rec in hostile.items():
                p.produce(t_in, enc(rec), name.encode(), partition=0)
            p.produce(t_in, b"JUNK" + b"x" * 1_000_500, b"big", partition=0)
            p.produce(t_in, b"\x00\x01junk", b"big-header", partition=0, headers=[("h", b"y" * 1_000_000)])
    p.produce(t_in, enc(sample("good-ns", 200)), b"GPU-good-ns", partition=0)  # closes the window
    assert p.flush(30) == 0

    group, log = f"cb-poison-{new_id()}", tmp_path / "chargeback.log"
    prog = Progress(kafka, group, t_in)
    procs = {}
    try:
        procs["cb"] = start_service(
            kafka, topic_prefix, log, *ARGS, "--group-id", group, "--instance-id", "poison"
        )
        prog.wait_done(90, list(procs.values()))
        assert procs["cb"].poll() is None, log.read_text()[-3000:]
        assert stop_service(procs["cb"]) == 0, log.read_text()[-3000:]
    finally:
        prog.close()
        kill_left(procs)
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert out and all(math.isfinite(r["cost_total"]) and math.isfinite(r["energy_joules"]) for r in out)
    billed = {r["namespace"] for r in out if r["window_start_ms"] == T0}
    assert "good-ns" in billed and not billed & {"poison", "nan-ns", "inf-ns", "huge-ns", "mignan-ns"}
    good = [r for r in out if r["namespace"] == "good-ns" and r["window_start_ms"] == T0]
    assert sum(r["allocated_gpu_seconds"] for r in good) == pytest.approx(600)
    dlq = read_to_end(kafka, topic_prefix + topics.DEADLETTER)
    reasons = {m.key(): dict(m.headers())["gpupipe.dlq.reason"] for m in dlq}
    assert {k: reasons.get(k.encode()) for k in hostile} == {k: b"out-of-range" for k in hostile}
    assert {b"big", b"big-header"} <= set(reasons)
    assert len(dlq) == len(hostile) + 2, "each hostile record dead-lettered once"
    cut = next(dict(m.headers()) for m in dlq if m.key() == b"big")
    assert cut["gpupipe.dlq.truncated_value"] == b"1000504"
