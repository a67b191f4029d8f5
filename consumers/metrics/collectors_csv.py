"""dcgm-exporter's counters CSV (``-f/--collectors``): which fields to export, with TYPE and HELP.

Reads the file as dcgm-exporter does, so every row of dcgm-exporter's shipped files loads. A field
we serve is exported with the file's TYPE and HELP; a DCGM name we cannot serve is listed once at
start and skipped (an error with ``strict=True``); anything else is a startup error:
:class:`CountersError` lists every bad line at once.
More (format, rules): docs/inside-metrics.md, "collectors_csv.py".
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gpupipe.common.errors import ConfigError
from gpupipe.common.flag_files import read_text
from gpupipe_consumers.metrics import dialect, fields
from gpupipe_consumers.metrics.fields import FieldSpec, Kind

log = logging.getLogger("gpupipe.metrics")

DEFAULT_COUNTERS_RESOURCE = "default-counters.csv"
METRIC_TYPES = ("gauge", "counter", "untyped")
ALL_TYPES = (*METRIC_TYPES, "histogram", "summary", "label")
_AS_UNTYPED = ("histogram", "summary")


class CountersError(ConfigError):
    """The counters CSV is invalid; the message lists every offending line."""


@dataclass(frozen=True, slots=True)
class Counter:
    """One selected row: the field, the metric name (the file's), and the TYPE/HELP the file gave it."""

    spec: FieldSpec
    prom_type: str
    help: str
    line: int = 0
    metric_name: str = ""  # the name as written in the file (1.x names differ from spec.name)

    @property
    def name(self) -> str:
        return self.metric_name or self.spec.name


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A row the service cannot serve: listed once at start, never fatal (unless strict)."""

    line: int
    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class CounterSet:
    """The parsed file: metric rows in file order, label rows, and the rows left out."""

    metrics: tuple[Counter, ...]
    labels: tuple[Counter, ...]
    unsupported: tuple[Unsupported, ...] = ()
    source: str = "<string>"
    notes: tuple[str, ...] = ()  # duplicates, histogram -> untyped...

    @property
    def skipped(self) -> tuple[tuple[int, str], ...]:
        """(line, name) of the unsupported rows (older API)."""
        return tuple((u.line, u.name) for u in self.unsupported)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.metrics)

    def has_label(self, name: str) -> bool:
        return any(c.name == name for c in self.labels)

    def has(self, name: str) -> bool:
        return any(c.spec.name == name for c in self.metrics)


def _cell(text: str) -> str:
    """Strip spaces (and tabs) around a cell; drop CSV quotes the way Go's encoding/csv does, then
    spaces around the quoted text, as dcgm-exporter's ``strings.Trim(cell, " ")`` (``" a "`` -> ``a``)."""
    c = text.strip()
    if len(c) >= 2 and c[0] == '"' and c[-1] == '"':
        c = c[1:-1].replace('""', '"').strip(" ")
    return c


def parse_counters(text: str, *, source: str = "<string>", strict: bool = False) -> CounterSet:
    """Parse counters-CSV text. Raises :class:`CountersError` listing every bad line."""
    errors: list[str] = []
    unsupported: list[Unsupported] = []
    notes: list[str] = []
    metrics: list[Counter] = []
    labels: list[Counter] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cells = line.split(",", 2)
        if len(cells) < 3:
            errors.append(f"line {lineno}: expected 'FIELD, type, help', got {raw.strip()!r}")
            continue
        name, typ, help_ = (_cell(c) for c in cells)
        typ = typ.lower()
        if not name:
            errors.append(f"line {lineno}: empty field name")
            continue
        if typ not in ALL_TYPES:
            errors.append(
                f"line {lineno}: {name}: unsupported type {typ!r} (use one of {', '.join(ALL_TYPES)})"
            )
            continue
        if name in seen:
            notes.append(f"{name} (line {lineno}) duplicates line {seen[name]}: the first row is used")
            continue
        seen[name] = lineno
        spec = dialect.lookup(name)  # any generation's name: a 4.9 or 4.10 file loads as it is
        if spec is None:
            if not name.startswith(fields.DCGM_PREFIXES):
                errors.append(f"line {lineno}: {name}: unknown field (not a DCGM field name)")
            else:
                unsupported.append(Unsupported(lineno, name, "not carried by GpuSample"))
            continue
        if (typ == "label") != (spec.kind is Kind.LABEL):
            why = "a number cannot be a label" if typ == "label" else f"a string field cannot be a {typ}"
            unsupported.append(Unsupported(lineno, name, why))
            continue
        if typ in _AS_UNTYPED:
            notes.append(f"{name} (line {lineno}): type {typ} is exposed as untyped (one value per series)")
            typ = "untyped"
        row = Counter(spec, typ, help_, lineno, name)  # an empty HELP stays empty, as dcgm-exporter
        (labels if typ == "label" else metrics).append(row)
    if strict:
        errors.extend(f"line {u.line}: {u.name}: {u.reason}" for u in unsupported)
    if errors:
        raise CountersError(f"counters file {source}: " + "; ".join(errors))
    cs = CounterSet(tuple(metrics), tuple(labels), tuple(unsupported), source, tuple(notes))
    log_unsupported(cs)
    return cs


def log_unsupported(cs: CounterSet) -> None:
    """One warning listing every row left out, one info line for the notes (at load, once)."""
    if cs.unsupported:
        log.warning(
            "counters file %s: %d field(s) cannot be served and are left out (see "
            "gpupipe_metrics_unsupported_fields): %s",
            cs.source,
            len(cs.unsupported),
            ", ".join(f"{u.name} (line {u.line}: {u.reason})" for u in cs.unsupported),
        )
    if cs.notes:
        log.info("counters file %s: %s", cs.source, "; ".join(cs.notes))


def load_counters(path: str | Path | None = None, *, strict: bool = False) -> CounterSet:
    """Read a counters CSV file; ``None`` reads the default shipped with this package."""
    if path is None:
        return default_counters()
    text = read_text(path, "counters file", CountersError)
    return parse_counters(text, source=str(path), strict=strict)


def default_counters_text() -> str:
    """The text of the shipped default (dcgm-exporter's default set plus our profiling fields)."""
    return (
        resources.files("gpupipe_consumers.metrics")
        .joinpath(DEFAULT_COUNTERS_RESOURCE)
        .read_text(encoding="utf-8")
    )


def default_counters() -> CounterSet:
    return parse_counters(
        default_counters_text(), source=f"<package>/{DEFAULT_COUNTERS_RESOURCE}", strict=True
    )


def in_dialect(cs: CounterSet, which: str) -> CounterSet:
    """The selection under the names of dialect ``which`` (see :mod:`gpupipe_consumers.metrics.dialect`).

    Only rows written with a 4.8 DCGM name change (1.x names and rows already written with a newer
    name stay as they are): each becomes one row per generation of the dialect, under that
    generation's name, oldest first, keeping the file's TYPE and, unless its unit changes, its
    HELP. A name that would appear twice (a file listing several generations, or a field a newer
    generation did not rename) keeps its first row. ValueError for an unknown dialect."""
    gens = dialect.generations(which)
    if gens == (dialect.DEFAULT_DIALECT,):
        return cs

    def rows(group: tuple[Counter, ...]) -> tuple[Counter, ...]:
        out: dict[str, Counter] = {}
        for c in group:
            r = dialect.BY_OLD.get(c.name) if c.name == c.spec.name else None
            if r is None:
                out.setdefault(c.name, c)
                continue
            for g in gens:
                name = dialect.name_in(r, g)
                if name == c.name:
                    out.setdefault(name, c)
                else:
                    spec = dialect.NEW_SPECS[name]
                    out.setdefault(
                        name, Counter(spec, c.prom_type, spec.help if r.unit_change else c.help, c.line, name)
                    )
        return tuple(out.values())

    return dataclasses.replace(cs, metrics=rows(cs.metrics), labels=rows(cs.labels))


def all_counters() -> CounterSet:
    """Every field we can serve (handy for tests and for a "show me everything" config)."""
    metrics = tuple(Counter(s, s.prom_type, s.help) for s in fields.FIELDS if s.kind is not Kind.LABEL)
    labels = tuple(
        Counter(s, s.prom_type, s.help)
        for s in fields.FIELDS
        if s.kind is Kind.LABEL and s.name in _ALL_LABELS
    )
    return CounterSet(metrics, labels, (), "<all>")


_ALL_LABELS = frozenset({"DCGM_FI_DRIVER_VERSION"})  # "everything" keeps the usual label set
