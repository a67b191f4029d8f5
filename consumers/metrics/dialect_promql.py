"""PromQL that reads every naming generation: our rules and dashboards under any ``--dialect``.

A query written with dcgm-exporter 4.8's names finds nothing under ``--dialect dcgm-4.10``. Rather
than one copy of each rule file and dashboard per generation (which the operator would have to
match to the dialect, and which would break during a migration or on a fleet that mixes
exporters), each read of a renamed field becomes a read of either name, in the 4.8 unit::

    DCGM_FI_DEV_GPU_UTIL{s}
      -> (DCGM_FI_DEV_GPU_UTIL{s} or DCGM_FI_DEV_GPU_UTIL_RATIO{s} * 100)
    max_over_time(DCGM_FI_DEV_GPU_TEMP[1h])
      -> (max_over_time(DCGM_FI_DEV_GPU_TEMP[1h]) or max_over_time(DCGM_FI_DEV_GPU_TEMP_CELSIUS[1h]))
    absent(DCGM_FI_DEV_GPU_TEMP)
      -> (absent(DCGM_FI_DEV_GPU_TEMP) and absent(DCGM_FI_DEV_GPU_TEMP_CELSIUS))

The names and units come from :data:`gpupipe_consumers.metrics.dialect.RENAMES` alone. The 4.8 unit
keeps every threshold, panel unit and alert text as written. ``or`` matches on all labels: under a
list holding both generations the two series of a GPU carry the same labels (the label part of a
series is shared by its families), so the newer one is dropped and nothing counts twice.

:func:`every_generation` is idempotent, so a rule file can be both the source and the shipped
file: a check compares each expression with its rewrite (deploy/prometheus/every_dialect.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpupipe_consumers.metrics import dialect, fields
from gpupipe_consumers.metrics.fields import Kind

#: Range functions whose result scales with the samples (a unit factor applies after them).
LINEAR = frozenset(
    {
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "avg_over_time",
        "min_over_time",
        "max_over_time",
        "sum_over_time",
        "last_over_time",
        "stddev_over_time",
    }
)
#: Range functions whose result does not depend on the unit (counts of samples or of changes).
UNIT_FREE = frozenset({"changes", "resets", "count_over_time", "present_over_time"})
#: Functions true when nothing is there: under every name means under neither (``and``).
ABSENT = frozenset({"absent", "absent_over_time"})
#: Functions of an instant selector that read more than its values: applied to each name apart.
INSTANT_UNIT_FREE = frozenset({"timestamp"})

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_OFFSET = re.compile(r"\s+offset\s+-?[0-9A-Za-z_$]+")


def to_48_unit(r: dialect.Rename) -> str:
    """PromQL appended to a newer series to give its value in the 4.8 unit ('' when it is the same)."""
    if not r.unit_change:
        return ""
    old = fields.BY_NAME[r.old].kind
    by_new = {Kind.HERTZ: " / 1e6", Kind.JOULES: " * 1000", Kind.KIB: " / 1024"}
    by_old = {Kind.PERCENT: " * 100", Kind.MIB: " / 1048576"}
    assert r.kind is not None
    factor = by_new.get(r.kind) or by_old.get(old)
    if factor is None:
        raise ValueError(f"no way back to the 4.8 unit of {r.old} from {r.new}")
    return factor


@dataclass(frozen=True, slots=True)
class _Read:
    """One read of a renamed field in an expression: ``text[start:end]``, its either-name form."""

    start: int
    end: int
    either: str  # "OLD or NEW" (unparenthesised)


def _skip_string(text: str, i: int) -> int:
    """The index after the string literal that starts at ``text[i]``."""
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _closing(text: str, i: int, close: str) -> int:
    """The index after the ``close`` matching the bracket at ``text[i]``, quotes respected."""
    i += 1
    while i < len(text) and text[i] != close:
        i = _skip_string(text, i) if text[i] in "\"'`" else i + 1
    if i >= len(text):
        raise ValueError(f"no closing {close!r} in {text!r}")
    return i + 1


def _back(text: str, i: int) -> int:
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i


def _fwd(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _reads(expr: str) -> list[_Read]:
    """Every read of a 4.8 name that a newer generation renamed, outside string literals."""
    out: list[_Read] = []
    i = 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
            continue
        m = _IDENT.match(expr, i) if (c.isalpha() or c in "_:") else None
        if m is None:
            i += 1
            continue
        name, i = m.group(0), m.end()
        r = dialect.BY_OLD.get(name)
        if r is None or (i < len(expr) and expr[i] == "("):
            continue
        if fields.BY_NAME[r.old].kind is Kind.LABEL:
            raise ValueError(f"{expr!r} reads label {name}, renamed {r.new} in {r.since}: not rewritten")
        out.append(_read(expr, m.start(), i, r))
        i = out[-1].end
    return out


def _read(expr: str, start: int, end: int, r: dialect.Rename) -> _Read:
    """The read of ``r.old`` at ``expr[start:end]``: its selector, or the call of a function whose
    result depends on more than the values (a range function, ``absent``, ``timestamp``)."""
    if end < len(expr) and expr[end] == "{":
        end = _closing(expr, end, "}")
    ranged = end < len(expr) and expr[end] == "["
    if ranged:
        end = _closing(expr, end, "]")
    if m := _OFFSET.match(expr, end):
        end = m.end()
    if _fwd(expr, end) < len(expr) and expr[_fwd(expr, end)] == "@":
        raise ValueError(f"{expr!r}: @ modifiers are not rewritten")
    old_sel = expr[start:end]
    new_sel = r.new + old_sel[len(r.old) :]
    # the function whose only argument the selector is, if any
    paren, close = _back(expr, start) - 1, _fwd(expr, end)
    func = None
    if paren >= 0 and expr[paren] == "(" and close < len(expr) and expr[close] == ")":
        f = re.search(r"[A-Za-z_][A-Za-z0-9_]*$", expr[:paren].rstrip())
        func = f.group(0) if f else None
    if func not in ABSENT and func not in INSTANT_UNIT_FREE and not ranged:
        return _Read(start, end, f"{old_sel} or {new_sel}{to_48_unit(r)}")
    if func is None or (ranged and func not in LINEAR | UNIT_FREE | ABSENT):
        raise ValueError(f"{expr!r}: a range of {r.old} outside a known one-argument function")
    fstart = len(expr[:paren].rstrip()) - len(func)
    head, tail = expr[fstart:start], expr[end : close + 1]
    if func in ABSENT:
        return _Read(fstart, close + 1, f"{head}{old_sel}{tail} and {head}{new_sel}{tail}")
    factor = to_48_unit(r) if func in LINEAR else ""
    return _Read(fstart, close + 1, f"{head}{old_sel}{tail} or {head}{new_sel}{tail}{factor}")


def every_generation(expr: str) -> str:
    """``expr`` (4.8 names, or already rewritten) reading every generation's names, in 4.8 units.

    Idempotent: a read already in its either-name form stays as it is. ValueError for a read it
    cannot rewrite faithfully (a renamed label, a range under an unknown function, ``@``)."""
    out: list[str] = []
    last = 0
    for rd in _reads(expr):
        inside = rd.start > 0 and expr[rd.start - 1] == "("
        if inside and expr.startswith(rd.either + ")", rd.start):
            out.append(expr[last : rd.start + len(rd.either)])
            last = rd.start + len(rd.either)
            continue
        enclosed = inside and rd.end < len(expr) and expr[rd.end] == ")"
        out.append(expr[last : rd.start])
        out.append(rd.either if enclosed else f"({rd.either})")
        last = rd.end
    out.append(expr[last:])
    return "".join(out)


def every_generation_match(selector: str) -> str:
    """A series selector (Grafana's ``label_values``, the API's ``match[]``) matching a renamed
    field's series under every name: ``OLD{a="b"}`` -> ``{__name__=~"OLD|NEW", a="b"}``."""
    m = _IDENT.match(selector.strip())
    r = dialect.BY_OLD.get(m.group(0)) if m else None
    if m is None or r is None:
        return selector
    rest = selector.strip()[m.end() :]
    labels = rest[1:-1].strip() if rest.startswith("{") and rest.endswith("}") else None
    if labels is None and rest:
        raise ValueError(f"{selector!r} is not a series selector")
    names = f'__name__=~"{r.old}|{r.new}"'
    return "{" + (f"{names}, {labels}" if labels else names) + "}"


def renamed_reads(expr: str) -> list[str]:
    """Each read of a renamed field in ``expr``, as a query of its own in its either-name form
    (the data tests evaluate them under each dialect)."""
    return [f"({rd.either})" for rd in _reads(expr)]
