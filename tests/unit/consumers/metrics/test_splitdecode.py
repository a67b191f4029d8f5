"""The split GpuSample decoder (cached identity and tail, readings checked now and converted at
scrape) gives exactly what the whole-record decoder gives, fails where it fails, and the
exposition rendered from pending readings is the exposition rendered from decoded records (pure)."""

from __future__ import annotations

import io
import math
import random

import pytest
from fastavro import parse_schema, schemaless_reader

from gpupipe_consumers.metrics.collectors_csv import all_counters, default_counters, in_dialect
from gpupipe_consumers.metrics.decode import MetricsDecoder, projected_schema
from gpupipe_consumers.metrics.readings import MEMO_SIZE, PENDING, complete
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.validate import reading_range
from tests.unit.consumers.metrics.test_store import T_MS, blank

CODEC = AvroCodec()
ENC = CODEC.encoder("GpuSample")
WRITER = catalog.current("GpuSample").parsed
MIG = {
    "mig_uuid": "",
    "gpu_instance_id": 1,
    "compute_instance_id": 0,
    "profile": "1g.18gb",
    "slice_fraction": 1 / 7,
}


def fleet_records(ticks: int = 3) -> list[dict]:
    """Whole GPUs, MIG slices, time-shared GPUs with processes, HPC job nodes, XIDs."""
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=6, gpus_per_node=8, seed=4, mig_node_ratio=0.34, shared_node_ratio=0.34, hpc_nodes=1
        )
    )
    out: list[dict] = []
    for k in range(ticks):
        out += fleet.tick(T_MS + k * 1000)[0]
    return out


@pytest.mark.parametrize("counters", [default_counters, all_counters], ids=["default", "all"])
def test_split_records_complete_to_the_projection_fastavro_reads(counters) -> None:
    store = SeriesStore(counters())
    dec = MetricsDecoder(CODEC, store.renderer)
    reader = parse_schema(projected_schema(store.renderer))
    split = 0
    for rec in fleet_records():
        payload = ENC.encode(rec)
        got = dec.decode(payload).record
        split += PENDING in got
        assert complete(got) == schemaless_reader(io.BytesIO(payload[10:]), WRITER, reader)
    assert split == len(fleet_records())  # every record took the split path


def test_identity_and_tail_caches_follow_the_bytes() -> None:
    """A pod change, a MIG slice sharing its GPU's host/index/UUID, a serial number: each sample
    decodes to its own identity and tail, whatever was cached before; the caches stay bounded."""
    store = SeriesStore(all_counters())
    dec = MetricsDecoder(CODEC, store.renderer)
    fn = next(iter(dec._split.values()))
    pod = {
        "namespace": "a",
        "pod": "p1",
        "container": "c",
        "resource_name": "nvidia.com/gpu",
        "replica": None,
    }
    variants = [
        blank("GPU-0"),
        blank("GPU-0", allocations=[pod]),
        blank("GPU-0", allocations=[{**pod, "pod": "p2"}]),
        blank("GPU-0"),
        blank("GPU-0", serial="1320", vbios_version="96.00"),
        blank("GPU-0", mig={**MIG, "mig_uuid": "MIG-1"}),
        blank("GPU-0", mig={**MIG, "mig_uuid": "MIG-2", "gpu_instance_id": 2}),
    ]
    reader = parse_schema(projected_schema(store.renderer))
    for _ in range(2):
        for rec in variants:
            payload = ENC.encode(rec)
            want = schemaless_reader(io.BytesIO(payload[10:]), WRITER, reader)
            assert complete(dec.decode(payload).record) == want
    # a key per GPU and per MIG slice; under the GPU's, its latest allocations and the ones before
    assert len(fn.cache.spans) == 3
    assert all(len(entries) <= fn.cache.per_key == 2 for entries in fn.cache.spans.values())
    fn.cache.max_keys = 3
    for i in range(10):
        dec.decode(ENC.encode(blank(f"GPU-{i}")))
    assert len(fn.cache.spans) <= 3


def test_damaged_payloads_fail_or_decode_as_with_the_whole_record_decoder() -> None:
    """Every truncation and a few hundred byte changes: the split path says DecodeError exactly
    where the whole-record path does, and otherwise gives the same record."""
    store = SeriesStore(all_counters())
    split, whole = MetricsDecoder(CODEC, store.renderer), MetricsDecoder(CODEC, store.renderer, split=False)
    rng = random.Random(3)
    base = [ENC.encode(r) for r in fleet_records(1)[::16]]

    def outcome(dec: MetricsDecoder, payload: bytes) -> object:
        try:
            return complete(dec.decode(payload).record)
        except DecodeError as exc:
            return ("error", exc.reason)

    cases = [p[:cut] for p in base for cut in range(10, len(p))]
    for _ in range(300):
        p = bytearray(rng.choice(base))
        p[rng.randrange(10, len(p))] = rng.randrange(256)
        cases.append(bytes(p))
    for payload in cases:
        assert outcome(split, payload) == outcome(whole, payload)
    assert any(isinstance(outcome(split, c), tuple) for c in cases)


VALUES = [None, 0, 1, 7, 2**31 - 1, 2**40 + 3, -1, -(2**33)]
DOUBLES = [None, 0.0, -0.0, 0.5, 0.9995, 1.0, 61.5, 612.5, 1e12, 1e300, -0.25, math.nan, math.inf, -math.inf]


GOOD_VALUES = [v for v in VALUES if v is None or v >= 0]
GOOD_DOUBLES = [v for v in DOUBLES if v is None or (v >= 0 and not math.isinf(v) and not math.isnan(v))]


def random_sample(rng: random.Random, uuid: str, good: bool) -> dict:
    """Random readings; ``good``: none that the fast path hands to the checked one. Readings the
    contract bounds stay within their bounds (beyond them a sample is refused at ingest)."""
    rec = blank(uuid, timestamp_ms=T_MS)
    for f in catalog.current("GpuSample").raw["fields"]:
        t = f["type"]
        if not (isinstance(t, list) and len(t) == 2 and t[0] == "null"):
            continue
        values, doubles = (GOOD_VALUES, GOOD_DOUBLES) if good else (VALUES, DOUBLES)
        bounds = reading_range(f["name"])
        if bounds is not None:
            values = [v for v in values if v is None or bounds[0] <= v <= bounds[1]]
            doubles = [v for v in doubles if v is None or bounds[0] <= v <= bounds[1]]
        if t[1] in ("int", "long"):
            v = rng.choice(values)
            rec[f["name"]] = v if t[1] == "long" or v is None or abs(v) < 2**31 else 5
        elif t[1] == "double":
            rec[f["name"]] = rng.choice(doubles)
        elif t[1] == "boolean":
            rec[f["name"]] = rng.choice([None, False, True])
    rec["interval_ms"] = 1000
    rec["mig"] = None
    return within_power_limit(rec)


def within_power_limit(rec: dict) -> dict:
    """``rec`` with no power over 3x its limit (refused at ingest)."""
    limit = rec.get("power_limit_w")
    for name in ("power_w", "module_power_w"):
        if limit and limit > 0 and rec.get(name) and rec[name] > 3 * limit:
            rec[name] = limit
    return rec


@pytest.mark.parametrize(
    "options",
    [RenderOptions(), RenderOptions(virtual_gpus=True, split_shared=False)],
    ids=["default", "virtual_gpus"],
)
@pytest.mark.parametrize("dialect", ["dcgm-4.8", "both"])  # both: every kind of both generations
def test_exposition_from_pending_readings_equals_the_record_path(options, dialect, monkeypatch) -> None:
    """Random values (nulls, zero, -0.0, negatives, NaN, +-Inf, 64-bit and huge numbers) over
    rounds in which values change, stay and come back: the scrape from pending readings, with its
    text reuse and memos, is byte for byte the scrape from decoded records, and counts the same
    invalid values."""
    rng = random.Random(11)
    counters = in_dialect(all_counters(), dialect)
    lazy, eager = SeriesStore(counters, options=options), SeriesStore(counters, options=options)
    checked: list[int] = []
    inner = lazy.renderer._render_checked
    monkeypatch.setattr(lazy.renderer, "_render_checked", lambda *a: checked.append(1) or inner(*a))
    dec = MetricsDecoder(CODEC, lazy.renderer)
    pod = {
        "namespace": "a",
        "pod": "p1",
        "container": "c",
        "resource_name": "nvidia.com/gpu",
        "replica": None,
    }
    now = T_MS / 1000
    previous: dict[str, dict] = {}
    for rnd in range(12):
        for i in range(8):
            uuid = f"GPU-{i}"
            rec = random_sample(rng, uuid, good=rng.random() < 0.6)
            if uuid in previous and rng.random() < 0.5:  # some readings as last time
                keep = rng.sample(sorted(previous[uuid]), 40)
                rec.update({k: previous[uuid][k] for k in keep})
                within_power_limit(rec)
            if i % 3 == 0:
                rec["allocations"] = [pod, {**pod, "pod": "p2"}] if rnd % 2 else [pod]
            previous[uuid] = rec
            got = dec.decode(ENC.encode(rec)).record
            assert PENDING in got
            lazy.apply_sample(got, 0, now)
            eager.apply_sample(complete(got), 0, now)
        assert lazy.render(now) == eager.render(now)
        assert lazy.stats()["invalid"] == eager.stats()["invalid"]
    assert eager.stats()["invalid"]  # the bad values were there, and counted
    if not options.virtual_gpus:  # both paths ran: from the readings' bytes and the checked one
        assert 0 < len(checked) < 8 * 12


def test_value_text_memos_are_bounded() -> None:
    store = SeriesStore(default_counters())
    dec = MetricsDecoder(CODEC, store.renderer)
    plan = next(iter(dec._split.values())).plan
    now = T_MS / 1000
    n = MEMO_SIZE * 5 // 8  # 2n distinct values: more than a memo holds
    for k in range(2):
        for i in range(n):
            rec = blank(f"GPU-{i}", power_w=100.0 + k * n + i, total_energy_mj=k * n + i)
            store.apply_sample(dec.decode(ENC.encode(rec)).record, 0, now)
        text = store.render(now).decode()
    assert all(len(m) <= MEMO_SIZE for m in plan.memos)
    assert max(len(m) for m in plan.memos) == 2 * n - MEMO_SIZE  # filled, cleared, filled again
    assert f" {100.0 + 2 * n - 1:f}\n" in text  # the latest value, not a memo's stale one
