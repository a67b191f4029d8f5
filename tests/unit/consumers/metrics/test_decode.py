"""The metrics consumer's projected, generated GpuSample decoder gives the same exposition as a full
decode, and falls back to the codec for what it does not know (pure)."""

from __future__ import annotations

import io

import pytest
from fastavro import parse_schema, schemaless_reader

from gpupipe_consumers.metrics.collectors_csv import all_counters, default_counters
from gpupipe_consumers.metrics.decode import MetricsDecoder, projected_fields, projected_schema
from gpupipe_consumers.metrics.readings import complete
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError
from tests.unit.consumers.metrics.test_parity import STATES, complete_sample, complete_xid


@pytest.mark.parametrize("counters", [default_counters, all_counters], ids=["default", "all"])
@pytest.mark.parametrize("options", [RenderOptions(), RenderOptions(virtual_gpus=True, split_shared=False)])
def test_projected_decode_renders_the_same_exposition(counters, options) -> None:
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    full, fast = SeriesStore(counters(), options=options), SeriesStore(counters(), options=options)
    dec = MetricsDecoder(codec, fast.renderer)
    now = STATES["timestamp_ms"] / 1000
    for rec in STATES["samples"]:
        payload = enc.encode(complete_sample(rec))
        full.apply_sample(codec.decode(payload).record, 0, now)
        d = dec.decode(payload)
        got = complete(d.record)
        assert d.name == "GpuSample" and set(got) <= set(complete_sample(rec))
        assert len(got) < len(complete_sample(rec))  # projected
        fast.apply_sample(d.record, 0, now)
    assert fast.render(now) == full.render(now)


def test_projection_follows_the_counters() -> None:
    few = projected_fields(
        SeriesStore(default_counters(), options=RenderOptions(split_shared=False)).renderer
    )
    assert "power_w" in few and "processes" not in few and "ecc_sbe_aggregate_total" not in few
    assert "processes" in projected_fields(SeriesStore().renderer)


def test_other_records_and_bad_bytes_go_through_the_codec() -> None:
    codec = AvroCodec()
    dec = MetricsDecoder(codec, SeriesStore().renderer)
    xid = codec.encoder("XidEvent").encode(complete_xid(STATES["xid_events"][0]))
    assert dec.decode(xid).name == "XidEvent"
    good = codec.encoder("GpuSample").encode(complete_sample(STATES["samples"][0]))
    with pytest.raises(DecodeError):
        dec.decode(good[:-40])  # truncated body
    with pytest.raises(DecodeError):
        dec.decode(b"not avro at all")


def test_generated_paths_match_fastavro_on_edge_values() -> None:
    """The generator reads runs of nullable doubles with one struct call and varints inline: a null
    inside a run, zero, negative and 64-bit values, and a body cut inside a run decode as fastavro
    decodes them (or fail as corrupt)."""
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    store = SeriesStore(all_counters())
    dec = MetricsDecoder(codec, store.renderer)
    reader = parse_schema(projected_schema(store.renderer))
    base = complete_sample(STATES["samples"][0])
    variants = [
        {"gpu_util_ratio": None},  # first of a run
        {"dec_util_ratio": None, "power_w": 0.0},  # last of a run
        {"gr_engine_active_ratio": 0.5, "sm_active_ratio": None, "nvlink_rx_bytes_per_s": -1.5},
        {"fb_used_bytes": 2**62, "total_energy_mj": 2**40 + 3, "timestamp_ms": 2**50},
        {"sm_clock_mhz": -(2**31), "mem_clock_mhz": 63, "last_xid": 64, "gpu_index": -1},
    ]
    writer = catalog.current("GpuSample").parsed
    for change in variants:
        payload = enc.encode({**base, **change})
        want = schemaless_reader(io.BytesIO(payload[10:]), writer, reader)
        assert complete(dec.decode(payload).record) == want, change
    payload = enc.encode(base)
    run_at = payload.index(b"\x02", 60)  # somewhere in the readings: cut there
    for cut in (run_at, run_at + 5, len(payload) - 1):
        with pytest.raises(DecodeError):
            dec.decode(payload[:cut])


def _hostile_samples() -> list[tuple[str, dict]]:
    base = complete_sample(STATES["samples"][0])
    alloc = {**base["allocations"][0]} if base.get("allocations") else None
    out = [
        ("good", base),
        ("future", {**base, "timestamp_ms": base["timestamp_ms"] + 400 * 86_400_000}),
        ("hostname", {**base, "hostname": "h" * 300}),
        ("last_xid", {**base, "last_xid": -1}),
        ("power", {**base, "power_w": 1e300}),
        ("power-nan", {**base, "power_w": float("nan")}),
        ("power-negative", {**base, "power_w": -5.0}),
        ("ratio", {**base, "gpu_util_ratio": 7.0}),
        ("ratio-nan", {**base, "sm_active_ratio": float("nan")}),
        ("ratio-inf", {**base, "tensor_active_ratio": float("inf")}),
        ("temperature-cold", {**base, "gpu_temp_c": -100.0}),
        ("temperature-hot", {**base, "memory_temp_c": 1e12}),
        ("bandwidth", {**base, "pcie_tx_bytes_per_s": -1e300}),
        ("energy", {**base, "total_energy_mj": -1}),
        ("bytes", {**base, "fb_used_bytes": -(2**40)}),
    ]
    if base["processes"]:
        procs = [{**p, "process_name": "x" * 5000} for p in base["processes"]]
        out.append(("process", {**base, "processes": procs}))
    if alloc is not None:
        out.append(("namespace", {**base, "allocations": [{**alloc, "namespace": "n" * 100}]}))
    return out


def test_the_split_decoders_contract_check_gives_the_whole_records_verdict() -> None:
    """The consume loop asks a split-decoded sample for its own check (identity and tail checked once
    when first decoded, then only the fields read per sample): the verdict of
    gpupipe_schemas.validate.violation on the record, for good samples, hostile identities (which leave
    the split path), hostile per-sample fields and readings beyond the contract's bounds (left to
    the scrape, they went unchecked: dead-lettered now like on every other path), on a cold and on
    a warm cache."""
    from gpupipe_schemas.validate import violation

    codec = AvroCodec()
    dec = MetricsDecoder(codec, SeriesStore().renderer)
    enc = codec.encoder("GpuSample")
    now = STATES["timestamp_ms"]
    for _ in range(2):  # second round: identities come from the cache
        for case, rec in _hostile_samples():
            payload = enc.encode(rec)
            d = dec.decode(payload)
            check = getattr(d, "violation", None)
            got = check(now, now) if check is not None else violation(d.name, d.record, now, now)
            assert got == violation("GpuSample", codec.decode(payload).record, now, now), case
            assert (got is None) == (case == "good"), case
