"""A sample's metric readings, checked at ingest and converted at scrape (pure).

Why: the readings of a GpuSample (the run of some 50 nullable numbers between its identity and
its inventory fields) are most of its bytes, and walking them field by field in Python was most of
the ingest cost -- for values that no scrape shows when the next sample of the GPU arrives first
(one sample a second, one scrape every 2.5 s with an HA Prometheus pair: most samples). So the
split decoder (:mod:`gpupipe_consumers.metrics.splitdecode`) checks the readings' structure with one
regular expression (union indexes, varint lengths, fixed sizes: C speed, no Python per field) and
keeps the match in the record under :data:`PENDING`. Values are converted when the GPU's line list
is rendered, once per scrape, from its latest sample only, by a function generated per writer
schema and counters selection (:class:`ReadingsPlan`):

* each value goes straight from its bytes to its line text, with the checks and formats of
  :meth:`Renderer._render_fast <gpupipe_consumers.metrics.render.Renderer._render_fast>` (a test holds them
  equal); anything unusual (negative, NaN, Inf, a type the kind does not take) raises, and the
  caller renders the completed record (:func:`complete`) on the checked path, which counts it;
* a reading whose bytes equal those of the GPU's previous render keeps that render's value text
  (same bytes, same value, same text): rendering follows what changed, line by line.

The regular expression accepts a subset of what the generated decoder accepts (strict booleans,
varints of at most 10 bytes), so a record it refuses goes through the whole-record decoder, which
decodes it or raises the :class:`~gpupipe_schemas.errors.DecodeError` -- bad input is still dead-lettered
at ingest, never found at scrape.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from gpupipe_consumers.metrics.fields import Kind
from gpupipe_schemas.validate import reading_max, reading_range

#: Key of a record's pending readings (a :class:`Readings`); never a GpuSample field name.
PENDING = "__readings__"

_INT, _ROUND, _PERCENT, _MIB, _FLOAT, _BOOL = (
    int(k) for k in (Kind.INT, Kind.ROUND, Kind.PERCENT, Kind.MIB, Kind.FLOAT, Kind.BOOL)
)
#: Int readings printed scaled (base-unit names): kind -> the expression of the printed int.
_SCALED = {int(Kind.HERTZ): "v * 1000000", int(Kind.JOULES): "v // 1000", int(Kind.KIB): "v * 1024"}
_VARINT = rb"[\x80-\xff]{0,9}[\x00-\x7f]"
_BODY = {
    "null": b"",
    "boolean": rb"[\x00\x01]",
    "int": _VARINT,
    "long": _VARINT,
    "float": rb"[\x00-\xff]{4}",
    "double": rb"[\x00-\xff]{8}",
}
#: Python expression converting the bytes ``{g}`` of one reading to its value, per Avro type.
_CONVERT = {
    "boolean": "{g} == b'\\x01'",
    "int": "(_Z[{g}] if len({g}) < 3 else _zz({g}))",
    "long": "(_Z[{g}] if len({g}) < 3 else _zz({g}))",
    "float": "_f({g})[0]",
    "double": "_d({g})[0]",
}


def _zz(g: bytes) -> int:
    """A zig-zag varint's value from its bytes (already checked by the pattern)."""
    n = shift = 0
    for b in g:
        n |= (b & 127) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1)


def _small_varints() -> dict[bytes, int]:
    """Every one- and two-byte varint (readings are mostly small: indexes, clocks, counts)."""
    out = {bytes((a,)): (a >> 1) ^ -(a & 1) for a in range(128)}
    for a in range(128, 256):
        for b in range(128):
            n = (a & 127) | (b << 7)
            out[bytes((a, b))] = (n >> 1) ^ -(n & 1)
    return out


#: What the converter expressions use (generated code elsewhere gets these too).
CONVERT_ENV: dict[str, Any] = {
    "_Z": _small_varints(),
    "_zz": _zz,
    "_d": struct.Struct("<d").unpack,
    "_f": struct.Struct("<f").unpack,
}


class UnusualValue(ValueError):
    """A reading the fast path does not format (the checked path renders and counts it)."""


_ENV: dict[str, Any] = {**CONVERT_ENV, "_Bad": UnusualValue}


def base_type(shape: Any) -> tuple[str, bool] | None:
    """``(primitive, nullable)`` of a field shape the pattern can check, else None: a primitive
    other than a string, or a union of ``null`` and one such primitive."""
    if isinstance(shape, str):
        return (shape, False) if shape in _BODY and shape != "null" else None
    if isinstance(shape, list) and len(shape) == 2 and "null" in shape:
        other = shape[1] if shape[0] == "null" else shape[0]
        if isinstance(other, str) and other in _BODY and other != "null":
            return other, True
    return None


def _byte_class(lo: int, hi: int) -> bytes:
    if lo == hi:
        return b"\\x%02x" % lo
    return b"[\\x%02x-\\x%02x]" % (lo, hi)


def _digit_ranges(a: list[int], b: list[int]) -> list[list[tuple[int, int]]]:
    """Byte ranges, most significant first, whose products cover the numbers from ``a`` to ``b``
    (big-endian digit lists of one length) exactly."""
    if not a:
        return [[]]
    n = len(a) - 1
    if a[0] == b[0]:
        return [[(a[0], a[0]), *t] for t in _digit_ranges(a[1:], b[1:])]
    low_full, high_full = all(d == 0 for d in a[1:]), all(d == 255 for d in b[1:])
    first, last = a[0] + (not low_full), b[0] - (not high_full)
    out = [] if low_full else [[(a[0], a[0]), *t] for t in _digit_ranges(a[1:], [255] * n)]
    if first <= last:
        out.append([(first, last), *[(0, 255)] * n])
    if not high_full:
        out += [[(b[0], b[0]), *t] for t in _digit_ranges([0] * n, b[1:])]
    return out


def _le_range(lo: int, hi: int, size: int) -> list[list[bytes]]:
    """Byte classes, in buffer order, of the ``size``-byte little-endian unsigned numbers from
    ``lo`` to ``hi``: one list per alternative."""
    digits = [lo.to_bytes(size, "big"), hi.to_bytes(size, "big")]
    terms = _digit_ranges(list(digits[0]), list(digits[1]))
    return [[_byte_class(*r) for r in reversed(term)] for term in terms]


def _factored(alts: list[list[bytes]]) -> bytes:
    """One pattern of the alternatives, common leading classes matched once (the low bytes of a
    number are mostly any byte: without factoring, each alternative would read them again)."""
    groups: dict[bytes, list[list[bytes]]] = {}
    for alt in alts:
        groups.setdefault(alt[0], []).append(alt[1:])
    out = []
    for first, rests in groups.items():
        rest = [r for r in rests if r]
        out.append(first + (_factored(rest) if rest else b""))
    return out[0] if len(out) == 1 else b"(?:" + b"|".join(out) + b")"


_FLOAT_BITS = {"float": (4, "<f", "<I"), "double": (8, "<d", "<Q")}


def bounded_body(prim: str, lo: float, hi: float) -> bytes | None:
    """A pattern of the bytes of a ``prim`` reading within ``[lo, hi]`` (NaN never), or None when
    the type has no such pattern. It may refuse a value within the bounds (the whole-record path
    then decides), never admit one beyond them.

    IEEE 754 numbers of one sign order as their bit patterns do (the negative ones backwards), so
    a range of values is a range of unsigned numbers on each side of zero. Only the top two bytes
    (sign, exponent, the mantissa's first bits) are compared, which reads six bytes of each number
    as any byte: values sharing them with a bound, other than the bound itself, are left to the
    whole-record path. A zig-zag varint is non-negative when its first byte is even."""
    if prim in ("int", "long") and lo == 0 and hi == math.inf:
        even_last = b"".join(b"\\x%02x" % i for i in range(0, 128, 2))
        even_more = b"".join(b"\\x%02x" % i for i in range(128, 256, 2))
        return b"(?:[" + even_last + b"]|[" + even_more + b"][\\x80-\\xff]{0,8}[\\x00-\\x7f])"
    if prim not in _FLOAT_BITS or not (lo <= 0 <= hi and math.isfinite(lo) and math.isfinite(hi)):
        return None
    size, fmt, ufmt = _FLOAT_BITS[prim]

    def bits(x: float) -> int:
        return struct.unpack(ufmt, struct.pack(fmt, x))[0]

    shift = 8 * size - 16
    sign = 1 << (8 * size - 1)
    top, bottom = bits(hi), bits(-abs(lo)) if lo else sign  # -0.0 when lo is 0
    low_bytes = b"(?s:.){%d}" % (size - 2)
    alts = []
    for first, last in ((0, (top >> shift) - 1), (sign >> shift, (bottom >> shift) - 1)):
        if first <= last:
            alts += [[low_bytes, *two] for two in _le_range(first, last, 2)]
    for exact in dict.fromkeys((top, bottom)):
        alts.append([_byte_class(b, b) for b in exact.to_bytes(size, "little")])
    return _factored(alts)


def _field_pattern(shape: Any, capture: bool, bounds: tuple[float, float] | None = None) -> bytes:
    prim, nullable = base_type(shape)  # type: ignore[misc]
    body = _BODY[prim]
    if bounds is not None:
        body = bounded_body(prim, *bounds) or body
    body = b"(" + body + b")" if capture else body
    if not nullable:
        return body
    alts = []
    for i, branch in enumerate(shape):  # the index byte is zig-zag(i) = 2i
        alts.append(b"\\x%02x" % (2 * i) + (b"" if branch == "null" else body))
    return b"(?:" + b"|".join(alts) + b")"


class ReadingsPlan:
    """The readings of one writer schema (a run of checkable fields) for one counters selection.

    ``fields``: the run, ``(name, shape)`` in writer order; ``wanted``: the names the record needs
    (a group each); ``plan``: the renderer's value plan ``(source, kind, signed, family index,
    ...)``; sources outside the run are read from the record."""

    def __init__(
        self,
        fields: Sequence[tuple[str, Any]],
        wanted: set[str],
        plan: Sequence[tuple[Any, ...]],
        label: str = "GpuSample",
    ) -> None:
        self.fields = tuple(fields)
        self.types = {name: base_type(shape)[0] for name, shape in fields}  # type: ignore[index]
        names = [name for name, _ in fields if name in wanted]
        self.group = {name: i for i, name in enumerate(names)}
        # a reading the record carries is held to the contract's bounds by the pattern itself: a
        # sample beyond them leaves the split path, and the whole record's check dead-letters it
        self.pattern = re.compile(
            b"".join(
                _field_pattern(shape, name in self.group, reading_range(name) if name in self.group else None)
                for name, shape in fields
            )
        )
        self.match = self.pattern.match  # (buf, pos) -> re.Match | None
        self.nones: tuple[None, ...] = (None,) * len(names)
        self.memos: list[dict[bytes, bytes]] = []  # per reading: bytes -> value text
        self.lines_fn = self._gen_lines(plan, label)
        self.values_fn = self._gen_values(names, label)

    def convert_expr(self, name: str, g: str) -> str:
        """Expression converting group text ``g`` of field ``name`` (for generated code)."""
        return _CONVERT[self.types[name]].format(g=g)

    def _gen_values(self, names: list[str], label: str) -> Any:
        src = ["def values(gs):"]
        items = []
        for i, name in enumerate(names):
            src.append(f"    g = gs[{i}]")
            src.append(f"    v{i} = None if g is None else {self.convert_expr(name, 'g')}")
            items.append(f"{name!r}: v{i}")
        src.append(f"    return {{{', '.join(items)}}}")
        return _build(src, "values", f"readings {label}")

    def _gen_lines(self, plan: Sequence[tuple[Any, ...]], label: str) -> Any:
        """``lines(rec, gs, out, pg, po)``: fill the value slots of ``out`` (a copy of the view's
        template) from the groups ``gs``; ``pg``/``po``: the previous render's groups and lines.

        Per reading, cheapest first: null (no line); the same bytes as the GPU's previous render
        (its text again); bytes seen recently on any GPU (a bounded text memo per reading: the few
        values of a clock, a temperature, a utilisation); else convert, check and format."""
        src = ["def lines(rec, gs, out, pg, po):"]
        env: dict[str, Any] = {}
        for source, kind, signed, fi, *_ in plan:
            h, j = 2 * fi, 2 * fi + 1
            k = self.group.get(source)
            if k is None:  # outside the run: a decoded field of the record
                src.append(f"    v = rec[{source!r}]")
                src.append("    if v is None:")
                src.append(f"        out[{h}] = b''")
                src.append("    else:")
                src += _format(kind, signed, None, 8, reading_max(source))
                src.append(f"        out[{j}] = t")
                continue
            # one memo per reading and family: two families of one reading (a field under two
            # generations' names) print it in different units
            memo: dict[bytes, bytes] = {}
            self.memos.append(memo)
            m = f"{k}_{fi}"
            env[f"_m{m}"], env[f"_g{m}"] = memo, memo.get
            src.append(f"    g = gs[{k}]")
            src.append("    if g is None:")
            src.append(f"        out[{h}] = b''")
            src.append(f"    elif g == pg[{k}] and po[{j}]:")
            src.append(f"        out[{j}] = po[{j}]")
            src.append("    else:")
            src.append(f"        t = _g{m}(g)")
            src.append("        if t is None:")
            src.append(f"            v = {self.convert_expr(source, 'g')}")
            src += _format(kind, signed, self.types[source], 12, reading_max(source))
            src.append(f"            if len(_m{m}) >= {MEMO_SIZE}: _m{m}.clear()")
            src.append(f"            _m{m}[g] = t")
            src.append(f"        out[{j}] = t")
        src.append("    return out")
        return _build(src, "lines", f"readings {label}", env)


#: Entries per reading's text memo (cleared when full, so it follows what the fleet reports now).
MEMO_SIZE = 2048


def _format(kind: int, signed: bool, avro: str | None, ind: int, hi: float | None = None) -> list[str]:
    """Check ``v`` and format it into ``t`` as ``Renderer._render_fast`` does; raise otherwise.
    ``avro`` (the reading's type, None when unknown) drops checks that cannot fail; ``hi`` is the
    reading's bound (:func:`gpupipe_schemas.validate.reading_max`), beyond which it is no reading."""
    pad = " " * ind
    lines = _format_kind(kind, signed, avro, pad)
    if hi is None or lines[0].strip() == "raise _Bad":  # refused whatever its value
        return lines
    return [f"{pad}if not {-hi!r} <= v <= {hi!r}: raise _Bad", *lines]


def _format_kind(kind: int, signed: bool, avro: str | None, pad: str) -> list[str]:
    is_int = avro in ("int", "long")
    if kind == _INT:
        if avro is not None and not is_int:
            return [f"{pad}raise _Bad"]  # _render_fast takes ints only
        check = "v < 0" if is_int else "v < 0 or type(v) is not int"
        return [f"{pad}if {check}: raise _Bad", f"{pad}t = b'%d\\n' % v"]
    if kind in _SCALED:
        if avro is not None and not is_int:
            return [f"{pad}raise _Bad"]  # _render_fast takes ints only
        check = "v < 0" if is_int else "v < 0 or type(v) is not int"
        return [f"{pad}if {check}: raise _Bad", f"{pad}t = b'%d\\n' % ({_SCALED[kind]})"]
    if kind == _FLOAT:
        return [f"{pad}if v < 0 or v - v: raise _Bad", f"{pad}t = b'%f\\n' % v"]
    if kind == _PERCENT:
        return [f"{pad}if v < 0: raise _Bad", f"{pad}t = b'%d\\n' % round(v * 100)"]
    if kind == _ROUND:
        fmt = f"{pad}t = b'%d\\n' % round(v)"
        return [fmt] if signed else [f"{pad}if v < 0: raise _Bad", fmt]
    if kind == _MIB:
        return [f"{pad}if v < 0: raise _Bad", f"{pad}t = b'%d\\n' % (v >> 20)"]
    if kind == _BOOL:
        if avro is not None and avro != "boolean":
            return [f"{pad}raise _Bad"]
        return [f"{pad}if type(v) is not bool: raise _Bad", f"{pad}t = b'1\\n' if v else b'0\\n'"]
    raise ValueError(f"readings: kind {kind} is not a plain value")


def _build(src: list[str], name: str, label: str, env: dict[str, Any] | None = None) -> Any:
    scope = {**_ENV, **(env or {})}
    exec(compile("\n".join(src), f"<{label}>", "exec"), scope)
    fn = scope[name]
    fn.__source__ = "\n".join(src)
    return fn


class Readings:
    """One sample's pending readings: the pattern's match over its bytes, and the plan."""

    __slots__ = ("_gs", "m", "plan")

    def __init__(self, plan: ReadingsPlan, m: re.Match[bytes]) -> None:
        self.plan = plan
        self.m = m
        self._gs: tuple[bytes | None, ...] | None = None

    def groups(self) -> tuple[bytes | None, ...]:
        gs = self._gs
        if gs is None:
            gs = self._gs = self.m.groups()
        return gs

    def values(self) -> dict[str, Any]:
        """Every pending reading, converted (for the record paths: MIG merges, checked render)."""
        return self.plan.values_fn(self.groups())

    def kept(self, lines: list[bytes]) -> Kept:
        """What the GPU's next render reuses text from: these readings' bytes and the line list
        rendered from them (not the payload, which can go)."""
        return (self.plan, self.groups(), lines)

    def lines(self, rec: Mapping[str, Any], template: list[bytes], prev: Kept | None) -> list[bytes]:
        """The line list's value slots for a single-series view (``template``: its heads); raises
        :class:`UnusualValue` (or TypeError/OverflowError) for a reading the fast path leaves to the
        checked one. ``prev``: :meth:`kept` of the GPU's previous render, to reuse text from."""
        plan = self.plan
        gs = self._gs
        if gs is None:
            gs = self._gs = self.m.groups()
        if prev is not None and prev[0] is plan:
            return plan.lines_fn(rec, gs, template.copy(), prev[1], prev[2])
        return plan.lines_fn(rec, gs, template.copy(), plan.nones, ())


#: A previous render to reuse text from: (plan, the readings' bytes per group, its line list).
Kept = tuple[ReadingsPlan, tuple[bytes | None, ...], list[bytes]]


def complete(rec: Mapping[str, Any]) -> Mapping[str, Any]:
    """The record with its pending readings converted in (the record itself when none)."""
    pending = rec.get(PENDING)
    if pending is None:
        return rec
    out = dict(rec)
    del out[PENDING]
    out.update(pending.values())
    return out
