"""The Avro contract's framing: single-object by default, Confluent with a registry, raw with a
header naming the schema; all three decoded."""

import struct

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import RAW, SCHEMA_HEADER, SINGLE_OBJECT_MAGIC, AvroCodec, codec_from_url
from gpupipe_schemas.errors import DecodeError, EncodeError


@pytest.fixture(scope="module")
def records() -> tuple[list[dict], list[dict]]:
    fleet = SimulatedFleet(FleetConfig(nodes=8, gpus_per_node=8, seed=7, xid_rate_per_gpu_hour=3600))
    return fleet.tick(1_795_000_000_000)


def test_single_object_roundtrip(records: tuple[list[dict], list[dict]]) -> None:
    samples, xids = records
    assert xids, "xid rate of 1/s per GPU must produce events"
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    for rec in samples:
        payload = enc.encode(rec)
        assert payload[:2] == SINGLE_OBJECT_MAGIC
        assert payload[2:10] == catalog.current("GpuSample").fingerprint
        out = codec.decode(payload)
        assert out.name == "GpuSample" and out.framing == "single-object"
        assert out.record == rec
    xenc = codec.encoder("XidEvent")
    for x in xids:
        assert codec.decode(xenc.encode(x)).record == x


def test_fingerprint_is_crc64_avro_of_canonical_form() -> None:
    # Independent CRC-64-AVRO (Rabin) implementation from the Avro spec, to check fastavro's byte order.
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    from fastavro.schema import to_parsing_canonical_form

    pcf = to_parsing_canonical_form(catalog.current("XidEvent").parsed)
    fp = empty
    for b in pcf.encode():
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    assert catalog.current("XidEvent").fingerprint == struct.pack("<Q", fp)


def test_confluent_wire_format_with_registry(records: tuple[list[dict], list[dict]]) -> None:
    samples, _ = records
    codec = codec_from_url("mock://codec-test")
    payload = codec.encoder("GpuSample", "gpu.samples.v1").encode(samples[0])
    assert payload[0] == 0
    schema_id = struct.unpack(">I", payload[1:5])[0]
    assert schema_id >= 1
    assert codec.decode(payload).framing == "confluent"
    assert codec.decode(payload).record == samples[0]
    # The same decoder still reads single-object records: consumers accept both.
    assert codec.decode(AvroCodec().encoder("GpuSample").encode(samples[0])).record == samples[0]


def test_confluent_framing_without_registry_is_a_clear_error(records: tuple[list[dict], list[dict]]) -> None:
    payload = codec_from_url("mock://other").encoder("GpuSample", "t").encode(records[0][0])
    with pytest.raises(DecodeError) as ei:
        AvroCodec().decode(payload)
    assert ei.value.reason == "confluent-framing-without-registry"


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "empty-payload"),
        (None, "empty-payload"),
        (b'{"json": true}', "not-gpupipe-avro"),
        (SINGLE_OBJECT_MAGIC + b"\x00" * 8 + b"\x02", "unknown-schema-fingerprint"),
    ],
)
def test_garbage_is_rejected_with_a_reason(payload: bytes | None, reason: str) -> None:
    with pytest.raises(DecodeError) as ei:
        AvroCodec().decode(payload)
    assert ei.value.reason == reason


def test_truncated_body_is_corrupt(records: tuple[list[dict], list[dict]]) -> None:
    payload = AvroCodec().encoder("GpuSample").encode(records[0][0])
    with pytest.raises(DecodeError) as ei:
        AvroCodec().decode(payload[:40])
    assert ei.value.reason == "corrupt-avro-body"


def test_record_missing_required_field_fails_encode() -> None:
    with pytest.raises(EncodeError):
        AvroCodec().encoder("XidEvent").encode({"event_id": "x"})


def test_projection_reader_schema_reads_only_asked_fields(records: tuple[list[dict], list[dict]]) -> None:
    reader = {
        "type": "record",
        "name": "GpuSample",
        "namespace": "gpupipe.v1",
        "fields": [
            {"name": "timestamp_ms", "type": "long"},
            {"name": "uuid", "type": "string"},
            {"name": "power_w", "type": ["null", "double"], "default": None},
        ],
    }
    codec = AvroCodec(reader_schemas={"GpuSample": reader})
    rec = records[0][0]
    out = codec.decode(AvroCodec().encoder("GpuSample").encode(rec)).record
    assert out == {"timestamp_ms": rec["timestamp_ms"], "uuid": rec["uuid"], "power_w": rec["power_w"]}


def test_raw_framing_is_the_plain_body_named_by_a_header(records: tuple[list[dict], list[dict]]) -> None:
    samples, xids = records
    codec = AvroCodec()
    for name, recs in (("GpuSample", samples), ("XidEvent", xids)):
        enc = codec.encoder(name, framing=RAW)
        fp = catalog.current(name).fingerprint
        assert enc.headers == [(SCHEMA_HEADER, f"{name}@{fp.hex()}".encode())]
        for rec in recs[:20]:
            payload = enc.encode(rec)
            # exactly the bytes any Avro library writes for the record: no prefix
            assert payload == AvroCodec().encoder(name).encode(rec)[10:]
            out = codec.decode(payload, [("other", b"x"), *enc.headers])
            assert (out.name, out.framing, out.record) == (name, "raw", rec)


def test_raw_framing_reads_with_projection_and_per_topic_choice(
    records: tuple[list[dict], list[dict]],
) -> None:
    rec = records[0][0]
    writer = AvroCodec(framings={"gpu.samples.v1": RAW}).encoder("GpuSample", "gpu.samples.v1")
    assert writer.headers is not None
    assert AvroCodec(framings={"gpu.samples.v1": RAW}).encoder("GpuSample", "other").headers is None
    reader = {
        "type": "record",
        "name": "GpuSample",
        "fields": [{"name": "uuid", "type": "string"}],
    }
    out = AvroCodec(reader_schemas={"GpuSample": reader}).decode(writer.encode(rec), writer.headers)
    assert out.record == {"uuid": rec["uuid"]}


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (b"GpuSample@0000000000000000", "unknown-schema-fingerprint"),
        (b"GpuSample", "unknown-schema-fingerprint"),
        (b"", "unknown-schema-fingerprint"),
        (f"XidEvent@{catalog.current('GpuSample').fingerprint.hex()}".encode(), "schema-header-mismatch"),
    ],
)
def test_bad_schema_header_is_rejected_with_a_reason(
    records: tuple[list[dict], list[dict]], header: bytes, reason: str
) -> None:
    payload = AvroCodec().encoder("GpuSample", framing=RAW).encode(records[0][0])
    with pytest.raises(DecodeError) as ei:
        AvroCodec().decode(payload, [(SCHEMA_HEADER, header)])
    assert ei.value.reason == reason


def test_raw_body_without_its_header_is_not_decoded(records: tuple[list[dict], list[dict]]) -> None:
    # What a consumer gets when a header-stripping hop forwards the value: a dead letter, not a guess.
    for rec in records[0][:50]:
        payload = AvroCodec().encoder("GpuSample", framing=RAW).encode(rec)
        with pytest.raises(DecodeError):
            AvroCodec().decode(payload, [("unrelated", b"1")])


def test_confluent_framing_without_registry_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        AvroCodec().encoder("GpuSample", "t", framing="confluent")
