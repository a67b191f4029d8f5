"""The generated GpuSample decoder gives exactly what fastavro's projection gives, and fails the same way."""

from __future__ import annotations

import io
import random

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from gpupipe_consumers.chargeback.settings import projected_sample_schema
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import SINGLE_OBJECT_MAGIC, AvroCodec
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.fastdecode import SampleDecoder, build_fast_decoder
from tests.synthetic_fleet import FleetSpec, blank_sample, generate_fleet

CURRENT = catalog.current("GpuSample")
PROJECTED = projected_sample_schema(CURRENT.raw)
READER = parse_schema(catalog.strip_logical_types(PROJECTED))


def reference(payload: bytes, writer: dict) -> dict:
    return schemaless_reader(io.BytesIO(payload[10:]), writer, READER)


def samples() -> list[dict]:
    fleet = SimulatedFleet(FleetConfig(nodes=6, gpus_per_node=8, seed=12, mig_node_ratio=0.5))
    out = []
    for k in range(5):
        out += fleet.tick(1_795_000_000_000 + k * 1000)[0]
    out += [r.sample for r in generate_fleet(FleetSpec(gpus=12, hours=0.2))]
    out.append(blank_sample(timestamp_ms=0, hostname="", uuid="", pci_bus_id="", model_name="", gpu_index=0))
    out.append(
        blank_sample(
            timestamp_ms=-(2**62),
            hostname="nöde-ü-日本",
            gpu_index=-3,
            uuid="GPU-x" * 40,
            pci_bus_id="p",
            model_name="Acme ✓",
            mig_enabled=False,
            interval_ms=-5,
            gpu_lost=True,
            gpu_util_ratio=-0.0,
            power_w=1e308,
            total_energy_mj=2**63 - 1,
            sm_active_ratio=float("inf"),
            allocations=[
                {"namespace": f"ns{i}", "pod": "p", "container": "c", "resource_name": None, "replica": i}
                for i in range(70)
            ],
            processes=[
                {
                    "pid": 2**40,
                    "process_name": None,
                    "used_memory_bytes": None,
                    "sm_util_ratio": 0.25,
                    "mem_util_ratio": None,
                    "namespace": None,
                    "pod": "x",
                    "container": None,
                }
            ],
        )
    )
    return out


def test_same_records_as_fastavro_projection() -> None:
    dec = SampleDecoder(AvroCodec(reader_schemas={"GpuSample": PROJECTED}), PROJECTED)
    assert CURRENT.fingerprint in dec.fast
    enc = AvroCodec().encoder("GpuSample")
    for s in samples():
        payload = enc.encode(s)
        got = dec.decode(payload)
        want = reference(payload, CURRENT.parsed)
        assert got.name == "GpuSample" and got.framing == "single-object"
        assert got.record == want
        assert list(got.record) == list(want)  # same field order


def test_released_writer_schemas_decode_like_fastavro() -> None:
    dec = SampleDecoder(AvroCodec(reader_schemas={"GpuSample": PROJECTED}), PROJECTED)
    codec = AvroCodec(reader_schemas={"GpuSample": PROJECTED})
    for sv in (v for v in catalog.released() if v.name == "GpuSample"):
        names = {f["name"] for f in sv.raw["fields"]}
        for s in samples()[:50]:
            rec = {k: v for k, v in s.items() if k in names}
            buf = io.BytesIO()
            schemaless_writer(buf, sv.parsed, rec)
            payload = SINGLE_OBJECT_MAGIC + sv.fingerprint + buf.getvalue()
            assert dec.decode(payload).record == codec.decode(payload).record


def test_blocks_with_negative_counts_and_byte_sizes() -> None:
    # Avro lets writers prefix array/map blocks with a negative count and the block's byte size.
    writer = {
        "type": "record",
        "name": "T",
        "fields": [
            {"name": "skip_arr", "type": {"type": "array", "items": "long"}},
            {"name": "skip_map", "type": {"type": "map", "values": "string"}},
            {"name": "arr", "type": {"type": "array", "items": "int"}},
            {"name": "m", "type": {"type": "map", "values": ["null", "double"]}},
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B"]}},
            {"name": "f", "type": {"type": "fixed", "name": "F", "size": 3}},
            {"name": "fl", "type": "float"},
            {"name": "by", "type": "bytes"},
        ],
    }
    reader = {**writer, "fields": writer["fields"][2:]}
    fn = build_fast_decoder(writer, reader)
    assert fn is not None

    def zz(n: int) -> bytes:
        n = (n << 1) ^ (n >> 63)
        out = bytearray()
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
        return bytes(out)

    block = zz(5) + zz(-7)
    body = zz(1) + zz(300) + zz(-2) + zz(len(block)) + block + zz(0)  # skip_arr: plain, then sized
    entry = zz(1) + b"k" + zz(2) + b"vv"
    body += zz(-1) + zz(len(entry)) + entry + zz(0)  # skip_map: negative count + byte size
    items = zz(4) + zz(-9)
    body += zz(-2) + zz(len(items)) + items + zz(1) + zz(11) + zz(0)  # arr: two blocks
    body += zz(1) + zz(1) + b"a" + zz(0) + zz(0)  # m: {"a": None}
    body += zz(1) + b"xyz" + b"\x00\x00\xc0\x3f" + zz(2) + b"\x01\x02"
    parsed_w = parse_schema(writer)
    want = schemaless_reader(io.BytesIO(body), parsed_w, parse_schema(reader))
    assert (
        fn(body, 0)
        == want
        == {"arr": [4, -9, 11], "m": {"a": None}, "e": "B", "f": b"xyz", "fl": 1.5, "by": b"\x01\x02"}
    )


def test_corrupt_and_truncated_bodies_raise_decode_error() -> None:
    dec = SampleDecoder(AvroCodec(reader_schemas={"GpuSample": PROJECTED}), PROJECTED)
    payload = AvroCodec().encoder("GpuSample").encode(samples()[3])
    for cut in range(10, len(payload)):
        with pytest.raises(DecodeError):
            dec.decode(payload[:cut])
    rng = random.Random(5)
    for _ in range(300):
        junk = bytearray(payload)
        for _ in range(rng.randrange(1, 6)):
            junk[rng.randrange(10, len(junk))] = rng.randrange(256)
        try:
            dec.decode(bytes(junk))  # may decode (a changed digit): it must never raise anything else
        except DecodeError as exc:
            assert exc.reason == "corrupt-avro-body"


def test_other_framings_and_unknown_payloads_go_to_the_codec() -> None:
    dec = SampleDecoder(AvroCodec(reader_schemas={"GpuSample": PROJECTED}), PROJECTED)
    with pytest.raises(DecodeError) as e:
        dec.decode(b"")
    assert e.value.reason == "empty-payload"
    with pytest.raises(DecodeError) as e:
        dec.decode(SINGLE_OBJECT_MAGIC + b"\x00" * 8 + b"x")
    assert e.value.reason == "unknown-schema-fingerprint"
    xid = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=1, xid_rate_per_gpu_hour=1e9)).tick(0)[1][0]
    assert dec.decode(AvroCodec().encoder("XidEvent").encode(xid)).name == "XidEvent"


def test_no_generated_decoder_when_types_differ() -> None:
    writer = {"type": "record", "name": "T", "fields": [{"name": "a", "type": "int"}]}
    assert build_fast_decoder(writer, {**writer, "fields": [{"name": "a", "type": "long"}]}) is None
    assert (
        build_fast_decoder(writer, {**writer, "fields": [{"name": "b", "type": "int", "default": 1}]}) is None
    )
