"""GpuSample ingest for the metrics consumer: decode what changed, check the rest (pure).

:func:`build_split_decoder` generates, per writer schema, a function that reuses the decoded identity
and inventory tail when their bytes repeat, decodes ``processes`` and checks the readings against the
contract's bounds. Cached pieces are as valid as decoded and checked ones; the caches are bounded.
It returns None off the common path: the caller then uses the whole-record decoder.
More: docs/inside-metrics.md, "splitdecode.py".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gpupipe_consumers.metrics.readings import CONVERT_ENV, PENDING, Readings, ReadingsPlan, base_type
from gpupipe_schemas.fastdecode import CodeGen, compile_fields
from gpupipe_schemas.records import GPU_SAMPLE_BOUND_POWER
from gpupipe_schemas.validate import POWER_OVER_LIMIT, violation

SplitFn = Callable[[bytes], dict[str, Any] | None]

_KEY = (("hostname", "string"), ("gpu_index", "int"), ("uuid", "string"))
_KEY_LAST = "mig"  # the key runs to this field when the schema has it (a MIG slice is its own key)
_POWERS = frozenset(GPU_SAMPLE_BOUND_POWER)  # checked against the power limit too
_MIN_RUN = 8  # fewer checkable fields in a row: not worth a pattern, decode the whole record


class _Cache:
    """Identity bytes per key (newest first, ``per_key`` of them: the current allocations and the
    previous ones) and tail bytes -> decoded fields."""

    def __init__(self, max_keys: int, max_tails: int, per_key: int = 2) -> None:
        self.spans: dict[bytes, list[tuple[bytes, dict[str, Any]]]] = {}
        self.tails: dict[bytes, dict[str, Any]] = {}
        self.max_keys, self.max_tails, self.per_key = max_keys, max_tails, per_key

    def add_span(self, key: bytes, span: bytes, fields: dict[str, Any]) -> None:
        entries = self.spans.get(key)
        if entries is None:
            if len(self.spans) >= self.max_keys:
                self.spans.clear()
            entries = self.spans[key] = []
        entries.insert(0, (span, fields))
        del entries[self.per_key :]

    def add_tail(self, tail: bytes, fields: dict[str, Any]) -> None:
        if len(self.tails) >= self.max_tails:
            self.tails.clear()
        self.tails[tail] = fields


def _layout(fields: Sequence[tuple[str, Any]]) -> tuple[int, int, int, int] | None:
    """(end of the key, end of identity, start of readings, end of readings) as field indexes, or
    None when the schema does not have the layout this decoder relies on."""
    if not fields or fields[0] != ("timestamp_ms", "long") or tuple(fields[1:4]) != _KEY:
        return None
    names = [n for n, _ in fields]
    span_end = names.index("processes") if "processes" in names else 4
    key_end = names.index(_KEY_LAST) + 1 if _KEY_LAST in names[4:span_end] else 4
    best = (0, 0)
    i = span_end
    while i < len(fields):
        j = i
        while j < len(fields) and base_type(fields[j][1]) is not None:
            j += 1
        if j - i > best[1] - best[0]:
            best = (i, j)
        i = j + 1
    if best[1] - best[0] < _MIN_RUN:
        return None
    return key_end, span_end, best[0], best[1]


def build_split_decoder(
    fields: Sequence[tuple[str, Any]],
    wanted: set[str],
    pending: set[str],
    plan: Sequence[tuple[Any, ...]],
    *,
    label: str = "GpuSample",
    max_keys: int = 200_000,
    max_tails: int = 50_000,
) -> SplitFn | None:
    """The split decoder of one writer schema (``fields``: its ``(name, shape)`` list), or None.

    ``wanted``: the fields the record carries; ``pending``: those of them left to the scrape when
    they are readings; ``plan``: the renderer's value plan (for the generated line function)."""
    layout = _layout(fields)
    if layout is None:
        return None
    key_end, span_end, r0, r1 = layout
    run = list(fields[r0:r1])
    run_names = {n for n, _ in run}
    eager_run = (wanted - pending) & run_names
    rplan = ReadingsPlan(run, (wanted & run_names), plan, label)
    span = list(fields[1:span_end])
    span_fn = compile_fields(span, wanted & {n for n, _ in span}, f"{label} identity")
    tail = list(fields[r1:])
    tail_fn = compile_fields(tail, wanted & {n for n, _ in tail}, f"{label} tail")
    cache = _Cache(max_keys, max_tails)

    gen = CodeGen()
    gen.emit(1, "end = len(buf)")
    gen.emit(1, "pos = 10")
    gen.read("long", 1, "ts")
    gen.emit(1, "p1 = pos")
    for _, shape in fields[1:key_end]:
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
    gen.emit(2, "_add_span(key, buf[p1:pos], ident)")
    mid = list(fields[span_end:r0])
    mid_vars = gen.emit_fields(mid, {n: s for n, s in mid if n in wanted})
    gen.emit(1, "m = _match(buf, pos)")
    gen.emit(1, "if m is None: return None")
    if "power_limit_w" in rplan.group:  # the one bound of two readings: a power against its limit
        gen.emit(1, f"lim = m.group({rplan.group['power_limit_w'] + 1})")
        gen.emit(1, f"lim = 0.0 if lim is None else {rplan.convert_expr('power_limit_w', 'lim')}")
        for name in sorted(_POWERS & rplan.group.keys()):
            g = f"m.group({rplan.group[name] + 1})"
            over = f"{rplan.convert_expr(name, g)} > {POWER_OVER_LIMIT!r} * lim"
            gen.emit(1, f"if lim > 0 and {g} is not None and {over}: return None")
    gen.emit(1, "pos = m.end()")
    gen.emit(1, "tv = _tails_get(buf[pos:])")
    gen.emit(1, "if tv is None:")
    gen.emit(2, "tv, tail_end = _tail(buf, pos)")
    gen.emit(2, "if tail_end != end: raise ValueError(f'{end - tail_end} bytes after the record')")
    gen.emit(2, "if _bad(tv) is not None: return None")
    gen.emit(2, "_add_tail(buf[pos:], tv)")
    items = ["'timestamp_ms': ts"] if "timestamp_ms" in wanted else []
    items += [f"{n!r}: {v}" for n, v in mid_vars.items()]
    for name in sorted(eager_run, key=lambda n: rplan.group[n]):
        g = f"g{rplan.group[name]}"
        gen.emit(1, f"{g} = m.group({rplan.group[name] + 1})")
        items.append(f"{name!r}: None if {g} is None else {rplan.convert_expr(name, g)}")
    items.append(f"{PENDING!r}: _Readings(_plan, m)")
    gen.emit(1, f"return {{**ident, **tv, {', '.join(items)}}}")
    env = {
        **CONVERT_ENV,
        "_spans_get": cache.spans.get,
        "_add_span": cache.add_span,
        "_span": span_fn,
        "_match": rplan.match,
        "_tails_get": cache.tails.get,
        "_add_tail": cache.add_tail,
        "_tail": tail_fn,
        "_Readings": Readings,
        "_plan": rplan,
        # the bounds of a cached piece alone (no time: a piece has no timestamp)
        "_bad": lambda fields: violation(label, fields, None, 0),
    }
    fn = gen.build(["def decode(buf):", *gen.lines], f"{label} split", env)
    fn.cache = cache  # type: ignore[attr-defined]
    fn.plan = rplan  # type: ignore[attr-defined]
    # what the contract check still has to see per record (identity and tail were checked once)
    per_record = [n for n in ("timestamp_ms", *mid_vars, *eager_run) if n in wanted]
    fn.per_record = tuple(dict.fromkeys(per_record))  # type: ignore[attr-defined]
    return fn
