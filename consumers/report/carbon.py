"""Measured carbon: a window's measured GPU energy x the grid's carbon intensity where the node runs.

Method (location-based, as the GHG Protocol's Scope 2 guidance calls it): ``CO2e = energy x PUE x
intensity``, with *energy* the GPU energy chargeback measured for the row (energy-counter deltas;
power x time where the counter was missing, as the row says), *PUE* an optional facility factor
(default 1: GPU energy only, no cooling or host), and *intensity* the grid's gCO2e/kWh for the
node's zone at the window's start: from a time series when one covers that moment, else the zone's
static figure, else the file's default. Nothing here is estimated from utilisation or node runtime.

File format (YAML; see ``deploy/carbon.example.yaml``)::

    pue: 1.2                          # optional, >= 1
    default_gco2e_per_kwh: 400        # nodes whose zone has no figure (optional: else an error)
    zones:                            # static intensity per zone (or region)
      eu-north-1a: 45
      us-east-1a: 380
    node_list: nodes.json             # optional: `kubectl get nodes -o json`; each node's zone is
    zone_label: topology.kubernetes.io/zone   # this label's value (the default shown); tried first
    nodes:                            # node name (glob) -> zone, first match wins
      - match: "gpu-eu-*"
        zone: eu-north-1a
    series: intensity.csv             # optional: CSV zone,start,gco2e_per_kwh (start ISO 8601, UTC);
                                      #   a value holds from its start until the next one of its zone
"""

from __future__ import annotations

import bisect
import csv
import json
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from gpupipe.common.flag_files import read_text
from gpupipe.common.yaml_file import load_yaml
from gpupipe_consumers.report.chargeback_report import parse_time_ms
from gpupipe_consumers.report.errors import ReportOptionError

_KEYS = frozenset({"pue", "default_gco2e_per_kwh", "zones", "nodes", "series", "node_list", "zone_label"})
ZONE_LABEL = "topology.kubernetes.io/zone"


class CarbonConfigError(ReportOptionError):
    """The carbon intensity file is missing or malformed; the message names the entry."""


@dataclass(frozen=True)
class CarbonConfig:
    pue: float = 1.0
    default: float | None = None
    zones: dict[str, float] = field(default_factory=dict)
    nodes: tuple[tuple[str, str], ...] = ()  # (node glob, zone)
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # zone -> (starts, values)

    node_zones: dict[str, str] = field(default_factory=dict)  # from a NodeList's zone labels

    def zone_of(self, node: str) -> str | None:
        if node in self.node_zones:
            return self.node_zones[node]
        for pattern, zone in self.nodes:
            if fnmatchcase(node, pattern):
                return zone
        return None

    def intensity(self, node: str, ts_ms: int) -> float:
        """gCO2e per kWh for ``node`` at ``ts_ms``."""
        zone = self.zone_of(node)
        if zone is not None and zone in self.series:
            starts, values = self.series[zone]
            i = bisect.bisect_right(starts, ts_ms) - 1
            if i >= 0:
                return values[i]
        if zone is not None and zone in self.zones:
            return self.zones[zone]
        if self.default is None:
            raise CarbonConfigError(
                f"no carbon intensity for node {node!r} (zone {zone!r}): add it, or a default_gco2e_per_kwh"
            )
        return self.default

    def co2e_kg(self, node: str, ts_ms: int, energy_kwh: float) -> float:
        return energy_kwh * self.pue * self.intensity(node, ts_ms) / 1000.0


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise CarbonConfigError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def parse_series(text: str, source: str) -> dict[str, tuple[list[int], list[float]]]:
    rows: dict[str, list[tuple[int, float]]] = {}
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None or not {"zone", "start", "gco2e_per_kwh"} <= set(reader.fieldnames):
        raise CarbonConfigError(f"{source}: expected a CSV header zone,start,gco2e_per_kwh")
    for n, row in enumerate(reader, 2):
        try:
            start = parse_time_ms(row["start"])
            value = float(row["gco2e_per_kwh"])
        except (ReportOptionError, ValueError, TypeError) as exc:
            raise CarbonConfigError(f"{source}: line {n}: {exc}") from exc
        if value < 0 or not row["zone"]:
            raise CarbonConfigError(f"{source}: line {n}: zone must be set and intensity non-negative")
        rows.setdefault(row["zone"], []).append((start, value))
    out = {}
    for zone, points in rows.items():
        points.sort()
        out[zone] = ([p[0] for p in points], [p[1] for p in points])
    return out


def parse_node_list(path: Path, label: str) -> dict[str, str]:
    """Node name -> the value of ``label``, from ``kubectl get nodes -o json`` (a v1 NodeList)."""
    text = read_text(path, "node list", CarbonConfigError)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CarbonConfigError(f"node list {path} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise CarbonConfigError(f"node list {path}: expected a NodeList (kubectl get nodes -o json)")
    out = {}
    for item in data["items"]:
        md = item.get("metadata") or {} if isinstance(item, dict) else {}
        value = (md.get("labels") or {}).get(label)
        if md.get("name") and value:
            out[str(md["name"])] = str(value)
    return out


def parse_carbon_config(data: Any, source: str = "<carbon>", base: Path | None = None) -> CarbonConfig:
    if not isinstance(data, dict) or not set(data) <= _KEYS:
        raise CarbonConfigError(f"{source}: expected a mapping with keys among {', '.join(sorted(_KEYS))}")
    pue = _number(data.get("pue", 1.0), f"{source}: pue")
    if pue < 1.0:
        raise CarbonConfigError(f"{source}: pue must be at least 1, got {pue}")
    default = data.get("default_gco2e_per_kwh")
    zones_raw = data.get("zones") or {}
    if not isinstance(zones_raw, dict):
        raise CarbonConfigError(f"{source}: zones must map zone names to gCO2e/kWh")
    zones = {str(k): _number(v, f"{source}: zones.{k}") for k, v in zones_raw.items()}
    nodes = []
    for i, rule in enumerate(data.get("nodes") or []):
        if not isinstance(rule, dict) or set(rule) != {"match", "zone"}:
            raise CarbonConfigError(f"{source}: nodes[{i}]: expected exactly the keys match and zone")
        nodes.append((str(rule["match"]), str(rule["zone"])))
    series = {}
    if data.get("series"):
        path = Path(str(data["series"]))
        if base is not None and not path.is_absolute():
            path = base / path
        series = parse_series(read_text(path, f"series (of {source})", CarbonConfigError), str(path))
    node_zones: dict[str, str] = {}
    if data.get("node_list"):
        path = Path(str(data["node_list"]))
        if base is not None and not path.is_absolute():
            path = base / path
        node_zones = parse_node_list(path, str(data.get("zone_label") or ZONE_LABEL))
    return CarbonConfig(
        node_zones=node_zones,
        pue=pue,
        default=_number(default, f"{source}: default_gco2e_per_kwh") if default is not None else None,
        zones=zones,
        nodes=tuple(nodes),
        series=series,
    )


def load_carbon_config(path: str | Path) -> CarbonConfig:
    data = load_yaml(path, "carbon config", CarbonConfigError)
    return parse_carbon_config(data, str(path), Path(path).parent)
