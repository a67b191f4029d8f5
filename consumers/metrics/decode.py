"""GpuSample decoding for the metrics consumer: only the fields the exposition reads.

Decoding is most of a sample's ingest cost. Per known writer schema, the split decoder
(:mod:`gpupipe_consumers.metrics.splitdecode`) reuses the decoded identity and inventory of the GPU's
previous samples when their bytes are the same and leaves the readings to the scrape (checked now,
converted when rendered: :mod:`gpupipe_consumers.metrics.readings`). What it does not take goes through
the chargeback consumer's generated whole-record decoders (:mod:`gpupipe_schemas.fastdecode`),
with the projection this service's counters and layout need (:func:`projected_fields`). Records in
other framings, from unknown writers, or of another type go through the shared codec, so the
consume loop's dead-lettering of bad input is unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

from gpupipe_consumers.metrics.fields import Kind
from gpupipe_consumers.metrics.render import Renderer
from gpupipe_consumers.metrics.splitdecode import SplitFn, build_split_decoder
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import SINGLE_OBJECT_MAGIC, AvroCodec, Decoded, Headers, schema_header
from gpupipe_schemas.fastdecode import CORRUPT, SampleDecoder, writer_fields
from gpupipe_schemas.validate import fields_violation, violation

#: Read with ``.get`` by the store and renderer: kept when present in the writer schema.
OPTIONAL = ("mig_enabled", "interval_ms", "last_xid", "gpu_lost", "driver_version")
HEALTH = (
    "ecc_dbe_volatile_total",
    "row_remap_failure",
    "row_remap_pending",
    "retired_pages_pending",
    "gpu_recovery_action",
    "clock_event_reasons",
)


def projected_fields(renderer: Renderer) -> set[str]:
    """The GpuSample fields a store with this renderer reads."""
    out = renderer.needed_fields() | set(OPTIONAL)
    if renderer.options.split_shared or renderer.options.virtual_gpus:
        out.add("processes")  # per-pod shares
    if renderer.has_health:
        out |= set(HEALTH)
    if renderer.has_clock_count or renderer.has_clock_total:
        out.add("clock_event_reasons")
    if any(f.spec is not None and f.spec.kind is Kind.XID_LAST for f in renderer.families):
        out.add("last_xid")
    return out


def pending_fields(renderer: Renderer) -> set[str]:
    """Fields that may wait for the scrape: readings only the value text shows (not those the
    store reads per sample: staleness interval, last XID, health and clock-event state)."""
    out = {src for src, *_ in renderer.value_plan} - set(OPTIONAL)
    if renderer.has_health:
        out -= set(HEALTH)
    if renderer.has_clock_count or renderer.has_clock_total:
        out.discard("clock_event_reasons")
    return out


def projected_schema(renderer: Renderer) -> dict[str, Any]:
    raw = copy.deepcopy(catalog.current("GpuSample").raw)
    keep = projected_fields(renderer)
    raw["fields"] = [f for f in raw["fields"] if f["name"] in keep]
    return raw


class DecodedSample:
    """What the consume loop reads of a :class:`~gpupipe_schemas.codec.Decoded` (``name``, ``record``), for
    a sample: built in a third of the frozen dataclass's time, once per record.

    ``violation(broker_ms, now_ms)`` is the consume loop's contract check
    (:func:`gpupipe_schemas.validate.violation`) of this record. For a record of the split decoder,
    whose identity and tail were checked when first decoded (the same bytes make the same
    fields), only the fields it read for this sample are checked: the same verdict, at a fraction
    of the cost, which had grown to most of a sample's ingest time."""

    __slots__ = ("per_record", "record")
    name = "GpuSample"
    framing = "single-object"

    def __init__(self, record: dict[str, Any], per_record: tuple[str, ...] | None = None) -> None:
        self.record = record
        self.per_record = per_record  # None: check the whole record

    def violation(self, broker_ms: int | None, now_ms: int) -> str | None:
        if self.per_record is None:
            return violation(self.name, self.record, broker_ms, now_ms)
        return fields_violation(self.name, self.record, self.per_record, broker_ms, now_ms)


class MetricsDecoder:
    """Codec-shaped (``.decode(payload) -> Decoded``) for the consume loop."""

    def __init__(self, codec: AvroCodec, renderer: Renderer, *, split: bool = True) -> None:
        self.codec = codec
        self._samples = SampleDecoder(codec, projected_schema(renderer))
        self._fast = self._samples.fast
        self._split: dict[bytes, SplitFn] = {}
        wanted, pending = projected_fields(renderer), pending_fields(renderer)
        versions = [catalog.current("GpuSample"), *(v for v in catalog.released() if v.name == "GpuSample")]
        for sv in versions if split else ():
            if sv.fingerprint not in self._fast or SINGLE_OBJECT_MAGIC + sv.fingerprint in self._split:
                continue  # no whole-record decoder to fall back on (another layout): codec only
            fields = writer_fields(sv.raw)
            fn = None
            if fields is not None and wanted <= {n for n, _ in fields}:
                fn = build_split_decoder(fields, wanted, pending, renderer.value_plan)
            if fn is not None:
                self._split[SINGLE_OBJECT_MAGIC + sv.fingerprint] = fn

    def decode(self, payload: bytes | None, headers: Headers = None) -> Decoded | DecodedSample:
        if headers and schema_header(headers) is not None:  # raw-framed: the codec's
            return self.codec.decode(payload, headers)
        split = self._split.get(payload[:10]) if payload else None  # magic + fingerprint
        if split is not None and payload is not None:
            try:
                rec = split(payload)
            except CORRUPT:
                rec = None  # the whole-record path decodes it or says why not
            if rec is not None:
                return DecodedSample(rec, split.per_record)  # type: ignore[attr-defined]
        if payload and payload[:2] == SINGLE_OBJECT_MAGIC:
            fp = payload[2:10]
            fn = self._fast.get(fp)
            if fn is not None:
                try:
                    return DecodedSample(fn(payload, 10))
                except CORRUPT:
                    pass  # the shared path raises the DecodeError with its reason
        return self._samples.decode(payload)
