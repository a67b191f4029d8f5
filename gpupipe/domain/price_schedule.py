"""Effective-dated prices: which price table applies to usage at a given time.

A price change applies to usage from its ``valid_from`` on, never to windows before it, however
late they are replayed or corrected, and never depends on which process (old or new pod of a
rolling update) emits the window: the engine looks the table up by the window's start. Deploy a
change before its ``valid_from``, so that every instance knows it when the window opens.

File format: the plain price table of ``prices.py`` (valid for all time), optionally with
``changes``, each a ``valid_from`` time plus the keys that change from the previous version
(``models``, when given, replaces the whole list)::

    currency: USD
    energy_per_kwh: 0.14
    default_per_gpu_hour: 2.50
    models: [{match: NVIDIA H200, per_gpu_hour: 4.10}]
    changes:
      - valid_from: 2026-12-01T00:00:00Z     # on a window boundary (a whole hour for 1h windows)
        models: [{match: NVIDIA H200, per_gpu_hour: 3.60}]

The currency cannot change (records of one stream are summed). ``valid_from`` must be on a window
boundary (checked by :meth:`PriceSchedule.check_windows`), so no window ever has two prices.

Instances of a group must price alike, also while a rolling update runs old and new price files
side by side: each committed checkpoint carries the :func:`fingerprint` of its instance's schedule,
and :func:`divergence` tells from which usage time two schedules may price differently (see
``price_agreement.py`` for what the service does with it).
"""

from __future__ import annotations

import bisect
import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupipe.common.durations import format_iso_ms, parse_iso_ms
from gpupipe.common.errors import ConfigError
from gpupipe.common.yaml_file import load_yaml
from gpupipe.domain.prices import GpuPrice, PriceTable, PriceTableError, parse_price_table

_CHANGE_KEYS = frozenset({"valid_from", "energy_per_kwh", "default_per_gpu_hour", "models"})
FINGERPRINT_VERSIONS = 16
"""Versions a fingerprint names (the newest); each one's hash covers every version before it too."""

Fingerprint = tuple[tuple[int, str], ...]
"""Per price version, newest last: (valid_from in epoch ms, hash of it and of every earlier one)."""


@dataclass(frozen=True)
class PriceSchedule:
    """Price tables by ``valid_from`` (epoch ms, ascending); the first is valid from the beginning."""

    starts: tuple[int, ...]
    tables: tuple[PriceTable, ...]

    @property
    def currency(self) -> str:
        return self.tables[0].currency

    def at(self, ts_ms: int) -> PriceTable:
        """The table for usage at ``ts_ms``."""
        return self.tables[bisect.bisect_right(self.starts, ts_ms) - 1]

    def gpu_price(self, model: str) -> GpuPrice:
        """The price now in force (the newest version): for start-up messages only."""
        return self.tables[-1].gpu_price(model)

    def check_windows(self, window_ms: int) -> None:
        """Every change must start a window, or one window would mix two prices."""
        for start in self.starts[1:]:
            if start % window_ms:
                raise PriceTableError(
                    f"price change valid_from {format_iso_ms(start)} is not on a {window_ms // 1000}s "
                    "window boundary: one window would mix two prices"
                )


def _valid_from(value: Any, where: str) -> int:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return int(value.timestamp() * 1000)
    if isinstance(value, dt.date):
        return _valid_from(dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC), where)
    if not isinstance(value, str):
        raise PriceTableError(f"{where}: valid_from must be an ISO-8601 time, got {value!r}")
    try:
        return parse_iso_ms(value)
    except ConfigError as exc:
        raise PriceTableError(f"{where}: {exc}") from exc


def parse_price_schedule(data: Any, source: str = "<prices>") -> PriceSchedule:
    """A schedule from the YAML document's data (a plain table gives a one-version schedule)."""
    if not isinstance(data, dict):
        raise PriceTableError(f"{source}: expected a mapping at the top level")
    base = {k: v for k, v in data.items() if k != "changes"}
    changes = data.get("changes") or []
    if not isinstance(changes, list):
        raise PriceTableError(f"{source}: changes must be a list of {{valid_from, ...}} entries")
    current = dict(base)
    starts, tables = [0], [parse_price_table(base, source)]
    for i, change in enumerate(changes):
        where = f"{source}: changes[{i}]"
        if not isinstance(change, dict) or "valid_from" not in change:
            raise PriceTableError(f"{where}: expected a mapping with valid_from")
        unknown = set(change) - _CHANGE_KEYS
        if unknown:
            raise PriceTableError(
                f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_CHANGE_KEYS)})"
            )
        start = _valid_from(change["valid_from"], where)
        if start <= starts[-1]:
            raise PriceTableError(f"{where}: valid_from must be later than the previous version's")
        current.update({k: v for k, v in change.items() if k != "valid_from"})
        starts.append(start)
        tables.append(parse_price_table(current, where))
    return PriceSchedule(tuple(starts), tuple(tables))


def load_price_schedule(path: str | Path) -> PriceSchedule:
    """Read and validate a price file (fails at startup, never mid-stream)."""
    return parse_price_schedule(load_yaml(path, "price table", PriceTableError), str(path))


def table_digest(table: PriceTable) -> str:
    """A short, stable hash of what a table charges (not of how its file was written)."""
    doc = [
        table.currency,
        repr(table.energy_per_kwh),
        repr(table.default_per_gpu_hour),
        sorted((k, repr(v)) for k, v in table.exact.items()),
        [(k, repr(v)) for k, v in table.patterns],  # patterns: first match wins, order counts
    ]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]


def fingerprint(prices: PriceTable | PriceSchedule) -> Fingerprint:
    """The price versions of ``prices`` as a chain of hashes: equal entries mean equal schedules up to
    that version's ``valid_from`` and beyond, until the next entry."""
    versions = (
        list(zip(prices.starts, prices.tables, strict=True))
        if isinstance(prices, PriceSchedule)
        else [(0, prices)]
    )
    chain, out = "", []
    for start, table in versions:
        chain = hashlib.sha256(f"{chain}|{start}|{table_digest(table)}".encode()).hexdigest()[:12]
        out.append((start, chain))
    return tuple(out[-FINGERPRINT_VERSIONS:])


def _chain_at(fp: Fingerprint, ts: int) -> str | None:
    found = None
    for start, chain in fp:
        if start > ts:
            break
        found = chain
    return found


def divergence(ours: Fingerprint, theirs: Fingerprint) -> int | None:
    """The earliest usage time (epoch ms) from which two schedules may price differently; None when
    they are the same. 0 when they differ before the oldest version both fingerprints name."""
    if ours == theirs:
        return None
    if not ours or not theirs:
        return 0
    low = max(ours[0][0], theirs[0][0])
    if _chain_at(ours, low) != _chain_at(theirs, low):
        return 0
    differ = {e for e in ours if e[0] >= low} ^ {e for e in theirs if e[0] >= low}
    return min(start for start, _ in differ) if differ else None
