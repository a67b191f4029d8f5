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

import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpupipe_consumers.metrics.fields import Kind
from gpupipe_consumers.plumbing.avro_patterns import CONVERT as _CONVERT
from gpupipe_consumers.plumbing.avro_patterns import CONVERT_ENV, base_type
from gpupipe_consumers.plumbing.avro_patterns import field_pattern as _field_pattern
from gpupipe_schemas.validate import reading_max, reading_range

#: Key of a record's pending readings (a :class:`Readings`); never a GpuSample field name.
PENDING = "__readings__"

_INT, _ROUND, _PERCENT, _MIB, _FLOAT, _BOOL = (
    int(k) for k in (Kind.INT, Kind.ROUND, Kind.PERCENT, Kind.MIB, Kind.FLOAT, Kind.BOOL)
)
#: Int readings printed scaled (base-unit names): kind -> the expression of the printed int.
_SCALED = {int(Kind.HERTZ): "v * 1000000", int(Kind.JOULES): "v // 1000", int(Kind.KIB): "v * 1024"}


class UnusualValue(ValueError):
    """A reading the fast path does not format (the checked path renders and counts it)."""


_ENV: dict[str, Any] = {**CONVERT_ENV, "_Bad": UnusualValue}


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
