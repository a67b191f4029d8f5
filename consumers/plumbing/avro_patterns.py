"""Byte patterns of Avro fields, for readers that check a run of a record's fields with one regex.

Contract: :func:`field_pattern` gives the pattern of one field whose shape :func:`base_type`
accepts (a primitive other than a string, or a union of null and one), optionally captured and
held to bounds (:func:`bounded_body`: it may refuse a value within them, never admit one beyond);
:data:`CONVERT` and :data:`CONVERT_ENV` turn a captured group back into its value in generated
code. Shared by the metrics split decoder and chargeback's sample decoder. Pure.
"""

from __future__ import annotations

import math
import struct
from typing import Any

__all__ = ["CONVERT", "CONVERT_ENV", "VARINT", "base_type", "bounded_body", "convert_expr", "field_pattern"]

VARINT = rb"[\x80-\xff]{0,9}[\x00-\x7f]"
_BODY = {
    "null": b"",
    "boolean": rb"[\x00\x01]",
    "int": VARINT,
    "long": VARINT,
    "float": rb"[\x00-\xff]{4}",
    "double": rb"[\x00-\xff]{8}",
}
#: Python expression converting the bytes ``{g}`` of one reading to its value, per Avro type.
CONVERT = {
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


def field_pattern(shape: Any, capture: bool, bounds: tuple[float, float] | None = None) -> bytes:
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


def convert_expr(prim: str, g: str) -> str:
    """Python expression converting the group text ``g`` of a ``prim`` field to its value."""
    return CONVERT[prim].format(g=g)
