"""GpuSample decoding for chargeback: the fields billing reads, the contract checked per field.

Contract: :class:`ChargebackDecoder` is codec-shaped (``decode(payload, headers)``). What it
returns holds exactly the fields of the reader schema it was given (the projection of
``settings.SAMPLE_FIELDS``), equal to what the generated whole-record decoder
(:class:`~gpupipe_schemas.fastdecode.SampleDecoder`) returns; :func:`sample_violation` of it is
:func:`gpupipe_schemas.validate.violation` of that record. What it cannot take (another framing,
an older writer schema of another layout, a corrupt body, a field out of bounds) goes through
that decoder and the codec, which decode it or raise the same :class:`DecodeError`: verdicts and
dead-letter reasons are unchanged.

How, per writer schema whose layout allows it (:func:`build_split_decoder`): the identity (host,
GPU, model, MIG slice, allocations) is decoded and checked once per distinct bytes and reused
while a GPU's next samples repeat them; ``processes`` is decoded; the run of readings after it is
matched by one regular expression (:mod:`gpupipe_consumers.plumbing.avro_patterns`) that checks
their structure and holds the billed readings to the contract's bounds; the inventory tail is
decoded and checked once per distinct bytes. The identity's ``allocations`` is a
:class:`~gpupipe_consumers.chargeback.accounting.SharedAllocations`: read-only and shared by those
samples, so accounting derives holders and workloads from it once. Per sample, only the time and
the fields decoded for it alone are left to check (:attr:`Sample.check`). Caches are bounded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpupipe_consumers.chargeback.accounting import SharedAllocations
from gpupipe_consumers.plumbing.avro_patterns import (
    CONVERT_ENV,
    base_type,
    bounded_body,
    convert_expr,
    field_pattern,
)
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import SINGLE_OBJECT_MAGIC, AvroCodec, Decoded, Headers, schema_header
from gpupipe_schemas.fastdecode import CORRUPT, CodeGen, SampleDecoder, compile_fields, writer_fields
from gpupipe_schemas.validate import fields_check, reading_range, violation

__all__ = ["ChargebackDecoder", "Sample", "build_split_decoder", "sample_violation"]

SplitFn = Callable[[bytes], dict[str, Any] | None]
Check = Callable[[Mapping[str, Any], int | None, int], str | None]

_NAME = "GpuSample"
_KEY = (("hostname", "string"), ("gpu_index", "int"), ("uuid", "string"))
#: Identities kept per key: a MIG GPU's slices share it (seven at most, and the parent), and each
#: GPU's allocations change now and then (the current and the previous ones).
_PER_KEY = 16
_INT_MEMO = 256  # values kept per int reading
_MIN_RUN = 8  # fewer pattern-checkable fields in a row: not worth a pattern


class Sample:
    """A decoded GpuSample (``name``, ``record`` as in :class:`Decoded`) and ``check``: the contract
    check of the fields decoded for this record alone (its split decoder's ``per_record``)."""

    __slots__ = ("check", "record")
    name = _NAME
    framing = "single-object"

    def __init__(self, record: dict[str, Any], check: Check) -> None:
        self.record = record
        self.check = check


def sample_violation(d: Decoded | Sample, broker_ms: int | None, now_ms: int) -> str | None:
    """The contract's verdict on a decoded sample: the whole record's, or, for a :class:`Sample`,
    its per-record fields' (the rest was checked, and passed, when those bytes were first seen)."""
    check = getattr(d, "check", None)
    if check is None:
        return violation(_NAME, d.record, broker_ms, now_ms)
    return check(d.record, broker_ms, now_ms)  # type: ignore[no-any-return]


class _Cache:
    """Identity bytes per GPU key (newest first, :data:`_PER_KEY` of them) and tail bytes, each
    with its decoded fields; cleared when full."""

    def __init__(self, max_keys: int, max_tails: int) -> None:
        self.spans: dict[bytes, list[tuple[bytes, dict[str, Any]]]] = {}
        self.tails: dict[bytes, dict[str, Any]] = {}
        self.max_keys, self.max_tails = max_keys, max_tails

    def add_span(self, key: bytes, span: bytes, fields: dict[str, Any]) -> None:
        entries = self.spans.get(key)
        if entries is None:
            if len(self.spans) >= self.max_keys:
                self.spans.clear()
            entries = self.spans[key] = []
        entries.insert(0, (span, fields))
        del entries[_PER_KEY:]

    def add_tail(self, tail: bytes, fields: dict[str, Any]) -> None:
        if len(self.tails) >= self.max_tails:
            self.tails.clear()
        self.tails[tail] = fields


def _layout(fields: Sequence[tuple[str, Any]]) -> tuple[int, int, int] | None:
    """(end of the identity, start and end of the readings run) as field indexes; None when the
    schema does not have the layout this decoder relies on."""
    names = [n for n, _ in fields]
    if not fields or fields[0] != ("timestamp_ms", "long") or tuple(fields[1:4]) != _KEY:
        return None
    if "processes" not in names:
        return None
    span_end = names.index("processes")
    best = (0, 0)
    i = span_end + 1
    while i < len(fields):
        j = i
        while j < len(fields) and base_type(fields[j][1]) is not None:
            j += 1
        if j - i > best[1] - best[0]:
            best = (i, j)
        i = j + 1
    if best[1] - best[0] < _MIN_RUN:
        return None
    return span_end, best[0], best[1]


def _enforced(name: str, shape: Any) -> bool:
    """Whether the run's pattern holds this reading to the contract's bounds itself."""
    bounds = reading_range(name)
    prim = base_type(shape)
    return bounds is not None and prim is not None and bounded_body(prim[0], *bounds) is not None


def build_split_decoder(
    fields: Sequence[tuple[str, Any]],
    wanted: set[str],
    *,
    max_keys: int = 200_000,
    max_tails: int = 50_000,
) -> SplitFn | None:
    """The split decoder of one writer schema (``fields``: its ``(name, shape)`` list) for the
    ``wanted`` fields, or None when its layout does not allow one. The function returns the
    record, or None where the whole-record path must decide; it raises what the generated
    decoders raise on a corrupt body. ``fn.per_record``: the fields left to check per record."""
    layout = _layout(fields)
    if layout is None or not wanted <= {n for n, _ in fields}:
        return None
    span_end, r0, r1 = layout
    run = list(fields[r0:r1])
    captured = [name for name, _ in run if name in wanted]
    group = {name: i for i, name in enumerate(captured)}
    pattern = re.compile(
        b"".join(
            field_pattern(shape, name in group, reading_range(name) if name in group else None)
            for name, shape in run
        )
    )
    span = list(fields[1:span_end])
    span_fn = compile_fields(span, wanted & {n for n, _ in span}, f"{_NAME} identity")
    tail = list(fields[r1:])
    tail_fn = compile_fields(tail, wanted & {n for n, _ in tail}, f"{_NAME} tail")
    cache = _Cache(max_keys, max_tails)
    types = {name: base_type(shape)[0] for name, shape in run}  # type: ignore[index]

    gen = CodeGen()
    gen.emit(1, "end = len(buf)")
    gen.emit(1, "pos = 10")
    gen.read("long", 1, "ts")
    gen.emit(1, "p1 = pos")
    for _, shape in _KEY:  # host, GPU index, UUID
        gen.skip(shape, 1)
    gen.emit(1, "key = buf[p1:pos]")
    gen.emit(1, "ident = None")
    gen.emit(1, "entries = _spans_get(key)")
    gen.emit(1, "if entries is not None:")
    gen.emit(2, "for span, fields in entries:")
    gen.emit(3, "if buf.startswith(span, p1):")
    gen.emit(4, "ident = fields")
    gen.emit(4, "pos = p1 + len(span)")
    gen.emit(4, "break")
    gen.emit(1, "if ident is None:")
    gen.emit(2, "ident, pos = _span(buf, p1)")
    gen.emit(2, "if _bad(ident) is not None: return None")  # the whole-record path says why
    if "allocations" in wanted and "allocations" in {n for n, _ in span}:
        # shared by the GPU's samples while these bytes repeat: accounting derives from it once
        gen.emit(2, "ident['allocations'] = _Shared(ident['allocations'])")
    gen.emit(2, "_add_span(key, buf[p1:pos], ident)")
    mid = list(fields[span_end:r0])
    mid_vars = gen.emit_fields(mid, {n: s for n, s in mid if n in wanted})
    gen.emit(1, "m = _match(buf, pos)")
    gen.emit(1, "if m is None: return None")
    gen.emit(1, "pos = m.end()")
    gen.emit(1, "tv = _tails_get(buf[pos:])")
    gen.emit(1, "if tv is None:")
    gen.emit(2, "tv, tail_end = _tail(buf, pos)")
    gen.emit(2, "if tail_end != end: raise ValueError(f'{end - tail_end} bytes after the record')")
    gen.emit(2, "if _bad(tv) is not None: return None")
    gen.emit(2, "_add_tail(buf[pos:], tv)")
    items = ["'timestamp_ms': ts"] if "timestamp_ms" in wanted else []
    items += [f"{n!r}: {v}" for n, v in mid_vars.items()]
    if captured:
        gen.emit(1, "gs = m.groups()")
    memos: dict[str, dict[bytes, int]] = {}
    for name in captured:
        k = group[name]
        g, v = f"g{k}", f"v{k}"
        gen.emit(1, f"{g} = gs[{k}]")
        if types[name] != "int":
            items.append(f"{name!r}: None if {g} is None else {convert_expr(types[name], g)}")
            continue
        # an int reading (the interval, replicas) takes few values: its bytes' value is kept
        memos[f"_m{k}"] = {}
        gen.emit(1, f"{v} = None if {g} is None else _m{k}.get({g})")
        gen.emit(1, f"if {v} is None and {g} is not None:")
        gen.emit(2, f"{v} = {convert_expr('int', g)}")
        gen.emit(2, f"if len(_m{k}) < {_INT_MEMO}: _m{k}[{g}] = {v}")
        items.append(f"{name!r}: {v}")
    gen.emit(1, f"return {{**ident, **tv, {', '.join(items)}}}")
    env = {
        **CONVERT_ENV,
        "_spans_get": cache.spans.get,
        "_add_span": cache.add_span,
        "_span": span_fn,
        "_match": pattern.match,
        "_tails_get": cache.tails.get,
        "_add_tail": cache.add_tail,
        "_tail": tail_fn,
        "_Shared": SharedAllocations,
        **memos,
        # the bounds of a cached piece alone (no time: a piece has no timestamp)
        "_bad": lambda piece: violation(_NAME, piece, None, 0),
    }
    fn = gen.build(["def decode(buf):", *gen.lines], f"{_NAME} chargeback split", env)
    fn.cache = cache  # type: ignore[attr-defined]
    # checked per record: the time, what was decoded for this record alone, and the readings
    # whose bounds the pattern does not hold them to
    loose = [n for n, shape in run if n in group and not _enforced(n, shape)]
    per_record = [n for n in ("timestamp_ms", *mid_vars, *loose) if n in wanted]
    fn.per_record = tuple(dict.fromkeys(per_record))  # type: ignore[attr-defined]
    fn.check = fields_check(_NAME, fn.per_record)  # type: ignore[attr-defined]
    return fn  # type: ignore[no-any-return]


class ChargebackDecoder:
    """Codec-shaped (``decode(payload, headers) -> Decoded | Sample``); see the module docstring."""

    def __init__(self, codec: AvroCodec, reader_raw: dict[str, Any]) -> None:
        self.codec = codec
        self.samples = SampleDecoder(codec, reader_raw)  # the whole-record path
        wanted = {f["name"] for f in reader_raw["fields"]}
        self._split: dict[bytes, SplitFn] = {}
        versions = [catalog.current(_NAME), *(v for v in catalog.released() if v.name == _NAME)]
        for sv in versions:
            prefix = SINGLE_OBJECT_MAGIC + sv.fingerprint
            if sv.fingerprint not in self.samples.fast or prefix in self._split:
                continue  # fields of other types than the reader's: fastavro resolves them
            fields = writer_fields(sv.raw)
            fn = None if fields is None else build_split_decoder(fields, wanted)
            if fn is not None:
                self._split[prefix] = fn

    def decode(self, payload: bytes | None, headers: Headers = None) -> Decoded | Sample:
        if headers and schema_header(headers) is not None:  # raw-framed: the codec's
            return self.codec.decode(payload, headers)
        split = self._split.get(payload[:10]) if payload else None  # magic + fingerprint
        if split is not None and payload is not None:
            try:
                rec = split(payload)
            except CORRUPT:
                rec = None  # the whole-record path decodes it or says why not
            if rec is not None:
                return Sample(rec, split.check)  # type: ignore[attr-defined]
        return self.samples.decode(payload)
