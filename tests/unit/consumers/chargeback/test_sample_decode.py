"""Chargeback's sample decoder against the whole-record one it replaces: the same records, the same
contract verdicts and dead-letter reasons, the same bills (gpupipe_consumers.chargeback.sample_decode)."""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
from fastavro import schemaless_writer

from gpupipe.kafka import topics
from gpupipe_consumers.chargeback.accounting import SharedAllocations
from gpupipe_consumers.chargeback.sample_decode import ChargebackDecoder, Sample, sample_violation
from gpupipe_consumers.chargeback.settings import SAMPLE_FIELDS, projected_sample_schema
from gpupipe_consumers.chargeback.windows import WindowEngine
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import SINGLE_OBJECT_MAGIC, AvroCodec
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.fastdecode import SampleDecoder
from gpupipe_schemas.validate import violation
from tests.integration.test_poison_suite import _catalogue, _non_utf8
from tests.unit.schemas.test_fastdecode import samples as odd_samples

NOW = 1_795_000_000_000
PROJECTED = projected_sample_schema(catalog.current("GpuSample").raw)
CODEC = AvroCodec(reader_schemas={"GpuSample": PROJECTED})
ENCODE = AvroCodec().encoder("GpuSample").encode


def _fleet(ticks: int = 6) -> list[dict[str, Any]]:
    """MIG slices and parents, shared GPUs with processes, exclusive and idle GPUs."""
    fleet = SimulatedFleet(
        FleetConfig(nodes=8, gpus_per_node=8, seed=5, mig_node_ratio=0.4, shared_node_ratio=0.4)
    )
    out: list[dict[str, Any]] = []
    for k in range(ticks):
        out += fleet.tick(NOW - 3_600_000 + k * 10_000)[0]
    return out


def _outcome(decode: Any, payload: bytes | None, whole: bool) -> tuple[Any, ...]:
    """What the service does with ``payload``: dead-letter it (reason, detail) or bill the record."""
    try:
        d = decode(payload)
    except DecodeError as exc:
        return ("dead-letter", exc.reason, exc.detail)
    bad = violation(d.name, d.record, NOW, NOW) if whole else sample_violation(d, NOW, NOW)
    return ("dead-letter", "out-of-range", bad) if bad else ("record", d.name, d.record)


def test_the_same_records_as_the_whole_record_decoder() -> None:
    ours, whole = ChargebackDecoder(CODEC, PROJECTED), SampleDecoder(CODEC, PROJECTED)
    split = 0
    for s in _fleet() + odd_samples():
        p = ENCODE(s)
        got, want = ours.decode(p), whole.decode(p)
        assert got.name == "GpuSample"
        assert set(got.record) == set(SAMPLE_FIELDS)
        assert got.record == want.record
        split += isinstance(got, Sample)
    assert split > 300  # the fleet's samples take the split path


def test_identity_bytes_are_reused_and_a_changed_allocation_is_seen() -> None:
    ours = ChargebackDecoder(CODEC, PROJECTED)
    s = _fleet(1)[0]
    a, b = ours.decode(ENCODE(s)), ours.decode(ENCODE({**s, "timestamp_ms": s["timestamp_ms"] + 1}))
    assert type(a.record["allocations"]) is SharedAllocations
    assert a.record["allocations"] is b.record["allocations"]  # decoded and checked once
    moved = copy.deepcopy(s)
    moved["allocations"][0]["namespace"] = "moved-here"
    c = ours.decode(ENCODE(moved))
    assert c.record["allocations"][0]["namespace"] == "moved-here"
    assert ours.decode(ENCODE(s)).record["allocations"] is a.record["allocations"]  # both kept


@pytest.fixture(scope="module")
def hostile() -> list[tuple[bytes, bytes | None]]:
    """The poison suite's sample-topic catalogue, and faults in each part the decoder splits."""
    good = _fleet(1)[0]
    alloc = good["allocations"][0] if good["allocations"] else {"namespace": "a", "pod": "b"}
    proc = {"pid": 1, "process_name": "p", "used_memory_bytes": 1, "sm_util_ratio": 2.0}
    more = [
        (b"ratio-sm", ENCODE({**good, "sm_active_ratio": 1.5})),
        (b"ratio-sm-nan", ENCODE({**good, "sm_active_ratio": math.nan})),
        (b"energy-negative", ENCODE({**good, "total_energy_mj": -1})),
        (b"power-negative", ENCODE({**good, "power_w": -1.0})),
        (b"interval-negative", ENCODE({**good, "interval_ms": -5})),
        (b"replicas-zero", ENCODE({**good, "shared_replicas": 0})),
        (b"mig-configured", ENCODE({**good, "mig_configured_fraction": 1.5})),
        (b"parent-energy-negative", ENCODE({**good, "mig_parent_energy_mj": -7})),
        (b"process-ratio", ENCODE({**good, "processes": [proc]})),
        (
            b"process-name",
            ENCODE({**good, "processes": [{**proc, "sm_util_ratio": 0.5, "process_name": "x" * 5000}]}),
        ),
        (b"allocations-many", ENCODE({**good, "allocations": [alloc] * 257})),
        (b"host-long", ENCODE({**good, "hostname": "h" * 300})),
        (b"non-utf8-model", _non_utf8(ENCODE, {**good, "model_name": "QQQQQQQQ"})),
        (b"non-utf8-serial", _non_utf8(ENCODE, {**good, "serial": "QQQQQQQQ"})),
        (b"unread-temp", ENCODE({**good, "gpu_temp_c": -100.0})),  # not billed on: taken
        (b"unread-power-limit", ENCODE({**good, "power_w": 900.0, "power_limit_w": 100.0})),
    ]
    return [(k, v) for k, v, _ in _catalogue(AvroCodec(), good, NOW)[topics.SAMPLES]] + more


def test_every_hostile_sample_gets_the_same_verdict_and_reason(
    hostile: list[tuple[bytes, bytes | None]],
) -> None:
    ours, whole = ChargebackDecoder(CODEC, PROJECTED), SampleDecoder(CODEC, PROJECTED)
    good = ENCODE(_fleet(1)[0])
    for key, value in hostile:
        ours.decode(good)  # the GPU's identity and tail are cached: the hostile copy must not use them
        assert _outcome(ours.decode, value, False) == _outcome(whole.decode, value, True), key
    refused = {k for k, v in hostile if _outcome(ours.decode, v, False)[0] == "dead-letter"}
    taken = {k for k, v in hostile if _outcome(ours.decode, v, False)[0] == "record"}
    assert {b"power-nan", b"long-ns", b"trailing", b"truncated", b"ratio-sm", b"process-ratio"} <= refused
    assert {b"energy-negative", b"replicas-zero", b"mig-configured", b"non-utf8-model"} <= refused
    # fields chargeback does not read are skipped, not decoded: taken, as before
    assert {b"unread-temp", b"unread-power-limit", b"non-utf8-serial"} <= taken


def test_released_writer_schemas_decode_as_before() -> None:
    ours, codec = ChargebackDecoder(CODEC, PROJECTED), CODEC
    versions = [v for v in catalog.released() if v.name == "GpuSample"]
    assert versions
    for sv in versions:
        names = {f["name"] for f in sv.raw["fields"]}
        for s in _fleet(1)[:20]:
            buf = io.BytesIO()
            schemaless_writer(buf, sv.parsed, {k: v for k, v in s.items() if k in names})
            payload = SINGLE_OBJECT_MAGIC + sv.fingerprint + buf.getvalue()
            assert ours.decode(payload).record == codec.decode(payload).record


def test_the_same_bills_as_from_the_whole_record_decoder() -> None:
    """Exactly: the shared allocations' derived holders and workloads change no sum."""
    payloads = [ENCODE(s) for s in _fleet(40)]
    out = []
    for decode in (ChargebackDecoder(CODEC, PROJECTED).decode, SampleDecoder(CODEC, PROJECTED).decode):
        eng = WindowEngine(60_000, 10_000, instance_id="t")
        for off, p in enumerate(payloads):
            eng.add(decode(p).record, 0, off, NOW)
        out.append(sorted((r["record_id"], sorted(r.items())) for r in eng.flush_all()))
    assert out[0] == out[1]
    assert len(out[0]) > 20
