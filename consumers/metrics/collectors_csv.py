"""dcgm-exporter's counters CSV (``-f/--collectors``): which fields to export, with TYPE and HELP.

Format, as dcgm-exporter reads it::

    # a comment (a line whose first non-blank character is '#')
    DCGM_FI_DEV_GPU_TEMP,    gauge, GPU temperature (in C).
    DCGM_FI_DRIVER_VERSION,  label, Driver Version

Blank lines are ignored and spaces around each cell are stripped (the stock file has
``DCGM_FI_DEV_DEC_UTIL ,``). The help text is everything after the second comma, so a help
that contains commas still parses (dcgm-exporter itself would reject such a row).

The TYPE and HELP come from the file, as in dcgm-exporter; allowed types are ``gauge``,
``counter`` and ``label`` (``histogram``/``summary`` make no sense for a single value and are
rejected). A ``label`` row adds ``<FIELD>="<value>"`` to every series of the GPU instead of a
metric of its own; only fields that are strings (``DCGM_FI_DRIVER_VERSION``) can be labels.

Unknown field names -- the policy:

* a name that dcgm-exporter knows but GpuSample does not carry (``fields.UNAVAILABLE``: NVLink
  CRC counters, inforom versions, ``DCGM_EXP_GPU_HEALTH_STATUS``...) is **skipped with a
  warning**, so a stock dcgm-exporter CSV works unchanged (dcgm-exporter itself skips profiling
  rows the GPU cannot serve the same way). ``strict=True`` turns these into errors too;
* any other name (a typo, a field that does not exist), a malformed row, a bad type, a
  duplicate row, or a type that contradicts the field (a string as a gauge, a number as a
  label) is a **startup error**: :class:`CountersError` lists every bad line at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from consumers.metrics import fields
from consumers.metrics.fields import FieldSpec, Kind
from gpupipe.errors import ConfigError

log = logging.getLogger("gpupipe.metrics")

DEFAULT_COUNTERS_RESOURCE = "default-counters.csv"
METRIC_TYPES = ("gauge", "counter")
ALL_TYPES = (*METRIC_TYPES, "label")


class CountersError(ConfigError):
    """The counters CSV is invalid; the message lists every offending line."""


@dataclass(frozen=True, slots=True)
class Counter:
    """One selected row: the field, and the TYPE/HELP the file gave it."""

    spec: FieldSpec
    prom_type: str
    help: str
    line: int = 0

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class CounterSet:
    """The parsed file: metric rows in file order, label rows, and the rows skipped."""

    metrics: tuple[Counter, ...]
    labels: tuple[Counter, ...]
    skipped: tuple[tuple[int, str], ...] = ()  # (line, field name) of rows we cannot serve
    source: str = "<string>"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.metrics)

    def has_label(self, name: str) -> bool:
        return any(c.name == name for c in self.labels)


def parse_counters(text: str, *, source: str = "<string>", strict: bool = False) -> CounterSet:
    """Parse counters-CSV text. Raises :class:`CountersError` listing every bad line."""
    errors: list[str] = []
    skipped: list[tuple[int, str]] = []
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
        name, typ, help_ = (c.strip() for c in cells)
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
            errors.append(f"line {lineno}: {name}: duplicate of line {seen[name]}")
            continue
        seen[name] = lineno
        spec = fields.lookup(name)
        if spec is None:
            if name in fields.UNAVAILABLE and not strict:
                skipped.append((lineno, name))
                continue
            why = "not carried by GpuSample" if name in fields.UNAVAILABLE else "unknown field"
            errors.append(f"line {lineno}: {name}: {why}")
            continue
        if (typ == "label") != (spec.kind is Kind.LABEL):
            want = "label" if spec.kind is Kind.LABEL else "gauge or counter"
            errors.append(f"line {lineno}: {name}: type {typ!r} not possible for this field (use {want})")
            continue
        row = Counter(spec, typ, help_ or spec.help, lineno)
        (labels if typ == "label" else metrics).append(row)
    if errors:
        raise CountersError(f"counters file {source}: " + "; ".join(errors))
    if skipped:
        log.warning(
            "counters file %s: skipping %d field(s) GpuSample does not carry: %s",
            source,
            len(skipped),
            ", ".join(f"{n} (line {ln})" for ln, n in skipped),
        )
    return CounterSet(tuple(metrics), tuple(labels), tuple(skipped), source)


def load_counters(path: str | Path | None = None, *, strict: bool = False) -> CounterSet:
    """Read a counters CSV file; ``None`` reads the default shipped with this package."""
    if path is None:
        return default_counters()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CountersError(f"cannot read counters file {p}: {exc}") from exc
    return parse_counters(text, source=str(p), strict=strict)


def default_counters_text() -> str:
    """The text of the shipped default (dcgm-exporter's default set plus our profiling fields)."""
    return (
        resources.files("consumers.metrics").joinpath(DEFAULT_COUNTERS_RESOURCE).read_text(encoding="utf-8")
    )


def default_counters() -> CounterSet:
    return parse_counters(
        default_counters_text(), source=f"<package>/{DEFAULT_COUNTERS_RESOURCE}", strict=True
    )


def all_counters() -> CounterSet:
    """Every field we can serve (handy for tests and for a "show me everything" config)."""
    metrics = tuple(Counter(s, s.prom_type, s.help) for s in fields.FIELDS if s.kind is not Kind.LABEL)
    labels = tuple(Counter(s, s.prom_type, s.help) for s in fields.FIELDS if s.kind is Kind.LABEL)
    return CounterSet(metrics, labels, (), "<all>")
