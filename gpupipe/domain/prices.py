"""The price table: what a GPU-hour of each model and a kilowatt-hour cost.

File format (YAML; see ``deploy/prices.example.yaml``)::

    currency: USD                 # ISO 4217, every price below is in it
    energy_per_kwh: 0.12          # price of one kWh of GPU energy
    default_per_gpu_hour: 2.50    # models matching no entry (records say price_source=default)
    models:                       # exact names win over patterns; patterns: first match in file order
      - match: NVIDIA H200
        per_gpu_hour: 4.10
      - match: "NVIDIA H100*"     # glob (* ? [..]); matching ignores case
        per_gpu_hour: 3.20

A MIG slice is billed its slice fraction of its model's GPU-hour price. Unknown keys are an error
(a typo must not silently bill the default price).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from gpupipe.common.errors import ConfigError
from gpupipe.common.yaml_file import load_yaml


class PriceTableError(ConfigError):
    """The price table file is missing or malformed; the message names the file and the entry."""


EXACT = "exact"
PATTERN = "pattern"
DEFAULT = "default"

_CURRENCY = re.compile(r"^[A-Z]{3}$")
_GLOB_CHARS = frozenset("*?[")
_TOP_KEYS = frozenset({"currency", "energy_per_kwh", "default_per_gpu_hour", "models"})
_MODEL_KEYS = frozenset({"match", "per_gpu_hour"})


@dataclass(frozen=True, slots=True)
class GpuPrice:
    """The GPU-hour price found for one model, and how it was found."""

    per_gpu_hour: float
    source: str  # EXACT | PATTERN | DEFAULT


@dataclass(frozen=True)
class PriceTable:
    currency: str = "USD"
    energy_per_kwh: float = 0.0
    default_per_gpu_hour: float = 0.0
    exact: dict[str, float] = field(default_factory=dict)  # lower-cased model name -> price
    patterns: tuple[tuple[str, float], ...] = ()  # (lower-cased glob, price) in file order
    _cache: dict[str, GpuPrice] = field(default_factory=dict, repr=False, compare=False)

    def gpu_price(self, model: str) -> GpuPrice:
        """Price of one GPU-hour of ``model``: exact name, else the first matching pattern, else default."""
        hit = self._cache.get(model)
        if hit is None:
            hit = self._lookup(model)
            self._cache[model] = hit
        return hit

    def at(self, ts_ms: int) -> PriceTable:
        """A plain table is valid at every time (see ``price_schedule.py`` for dated changes)."""
        return self

    def _lookup(self, model: str) -> GpuPrice:
        name = model.strip().lower()
        if name in self.exact:
            return GpuPrice(self.exact[name], EXACT)
        for pattern, price in self.patterns:
            if fnmatchcase(name, pattern):
                return GpuPrice(price, PATTERN)
        return GpuPrice(self.default_per_gpu_hour, DEFAULT)


def _price(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PriceTableError(f"{where}: expected a number, got {value!r}")
    if value < 0 or value != value:  # negative or NaN
        raise PriceTableError(f"{where}: a price must be a non-negative number, got {value!r}")
    return float(value)


def parse_price_table(data: Any, source: str = "<prices>") -> PriceTable:
    """Build a PriceTable from the YAML document's data; errors name ``source`` and the entry."""
    if not isinstance(data, dict):
        raise PriceTableError(f"{source}: expected a mapping at the top level")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise PriceTableError(f"{source}: unknown keys {sorted(unknown)} (allowed: {sorted(_TOP_KEYS)})")
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not _CURRENCY.match(currency):
        raise PriceTableError(f"{source}: currency must be an ISO 4217 code such as USD, got {currency!r}")
    energy = _price(data.get("energy_per_kwh", 0.0), f"{source}: energy_per_kwh")
    default = _price(data.get("default_per_gpu_hour", 0.0), f"{source}: default_per_gpu_hour")
    models = data.get("models") or []
    if not isinstance(models, list):
        raise PriceTableError(f"{source}: models must be a list of {{match, per_gpu_hour}} entries")
    exact: dict[str, float] = {}
    patterns: list[tuple[str, float]] = []
    for i, entry in enumerate(models):
        where = f"{source}: models[{i}]"
        if not isinstance(entry, dict) or set(entry) != _MODEL_KEYS:
            raise PriceTableError(f"{where}: expected exactly the keys match and per_gpu_hour, got {entry!r}")
        match = entry["match"]
        if not isinstance(match, str) or not match.strip():
            raise PriceTableError(f"{where}: match must be a non-empty model name or glob")
        price = _price(entry["per_gpu_hour"], f"{where}.per_gpu_hour")
        name = match.strip().lower()
        if _GLOB_CHARS & set(name):
            patterns.append((name, price))
        elif name in exact:
            raise PriceTableError(f"{where}: model {match!r} is listed twice")
        else:
            exact[name] = price
    return PriceTable(currency, energy, default, exact, tuple(patterns))


def load_price_table(path: str | Path) -> PriceTable:
    """Read and validate a price table file (fails at startup, never mid-stream)."""
    return parse_price_table(load_yaml(path, "price table", PriceTableError), str(path))
