"""NVIDIA's "XID 144-150 Decode" sheet as data, and the decoder of an NVLink5 Xid's registers (pure).

Rules and reasons in full: docs/alerts.md, "Module notes", ``rules/nvlink5_decode.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

__all__ = [
    "ACTIONS",
    "Nvlink5Decode",
    "SheetError",
    "SheetRow",
    "decode_nvlink5",
    "layout_for_driver",
    "load_sheet",
    "sheet",
]

#: Immediate-action buckets the sheet uses, least to most disruptive.
ACTIONS = ("IGNORE", "XID_154_EVAL", "RESET_GPU")
_SEVERITIES = frozenset({"Fatal", "Fatal**", "Link Fatal", "Link Fatal?", "Non-fatal", "Non-fatal*"})
_PATTERN_RE = re.compile(r"^[01-]{32}$")
#: First driver branch that prints the V2 layout ("V2(>=R575)").
V2_FIRST_BRANCH = 575


class SheetError(ValueError):
    """``nvlink5_decode.json`` is malformed (a bad pattern, an unknown bucket, a missing field)."""


@dataclass(frozen=True, slots=True)
class _Mask:
    care: int
    value: int

    @classmethod
    def of(cls, pattern: str) -> _Mask:
        care = value = 0
        for ch in pattern:
            care, value = care << 1 | (ch != "-"), value << 1 | (ch == "1")
        return cls(care, value)

    def matches(self, intr: int) -> bool:
        return intr & self.care == self.value


@dataclass(frozen=True, slots=True)
class SheetRow:
    """One row of the sheet (fields as its columns; ``row`` is its 1-based position)."""

    row: int
    xid: int
    unit: str
    """As the sheet names it; ``"A/B"`` when V1 drivers print A and V2 drivers print B."""
    patterns: tuple[str, str]
    """IntrInfo bit patterns (V1, V2), 32 characters, bit 31 first."""
    error_status: frozenset[int] | None
    """Statuses the row covers; ``None`` when the sheet leaves it blank (any status)."""
    action: str
    action2_patterns: tuple[str, str] | None
    action2: str | None
    investigatory: str
    severity: str
    hw_sw: str
    local_remote: str
    source: str
    masks: tuple[_Mask, _Mask]
    action2_masks: tuple[_Mask, _Mask] | None

    def names(self, layout: int) -> frozenset[str]:
        """The unit names a driver of this layout prints for the row (normalised)."""
        parts = [_norm(p) for p in self.unit.split("/")]
        if len(parts) == 2:
            return frozenset({parts[layout - 1]})
        return frozenset(parts)

    @property
    def peer_at_fault(self) -> bool:
        """INVESTIGATE_PEER_DEVICE: the device at the other end of the link took it down."""
        return self.investigatory == "INVESTIGATE_PEER_DEVICE"


@dataclass(frozen=True, slots=True)
class Nvlink5Decode:
    """What the sheet says about one event."""

    rows: tuple[SheetRow, ...]
    """The matching row(s): one, or one per set bit of a bit-field error status (worst first)."""
    layout: int
    """1 (V1, < R575) or 2 (V2, >= R575)."""
    action: str
    """The immediate bucket: ``IGNORE``, ``XID_154_EVAL`` or ``RESET_GPU`` (Action 2 applied)."""
    action2: bool
    """The worst row's Action-2 decode matched (a promotable error that was promoted)."""
    subcode: int
    """The sub-unit field: IntrInfo[9:5] (V1) or IntrInfo[6:0] (V2)."""
    link_down_reason: int
    """IntrInfo[25:20]."""

    @property
    def row(self) -> SheetRow:
        return self.rows[0]

    @property
    def investigatory(self) -> str:
        return self.row.investigatory

    @property
    def severity(self) -> str:
        return self.row.severity

    @property
    def peer_at_fault(self) -> bool:
        return self.row.peer_at_fault

    def describe(self) -> str:
        """``row 47 NETIR_LINK_EVT/NETIR_LINK_DOWN (V1, reason 37 = 100101), Link Fatal``."""
        r = self.row
        where = f"V{self.layout}"
        if r.xid == 149 and "LINK" in r.unit:
            where += f", link-down reason {self.link_down_reason} = {self.link_down_reason:06b}"
        rows = "+".join(str(x.row) for x in self.rows)
        return f"sheet row {rows} {r.unit} ({where}), {r.severity}" + (", Action 2" if self.action2 else "")


def _norm(name: str) -> str:
    return "_".join(name.upper().split())


def _pattern(raw: dict[str, Any], key: str, row: int) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or _PATTERN_RE.match(value) is None:
        raise SheetError(f"row {row}: {key} must be 32 characters of 0, 1 and -, not {value!r}")
    return value


def _row(raw: Any, index: int) -> SheetRow:
    if not isinstance(raw, dict):
        raise SheetError(f"row {index}: not an object")
    try:
        xid = raw["xid"]
        if not isinstance(xid, int) or not 144 <= xid <= 150:
            raise SheetError(f"row {index}: xid {xid!r} is not 144-150")
        p1, p2 = _pattern(raw, "intr_v1", index), _pattern(raw, "intr_v2", index)
        status = raw["error_status"]
        if status is not None and (not status or not all(isinstance(s, int) and s >= 0 for s in status)):
            raise SheetError(f"row {index}: error_status must be null or a list of integers")
        action, action2 = raw["action"], raw.get("action2")
        if action not in ACTIONS or (action2 is not None and action2 not in ACTIONS):
            raise SheetError(f"row {index}: unknown bucket {action!r} / {action2!r}")
        a2: tuple[str, str] | None = None
        if action2 is not None:
            a2 = (_pattern(raw, "action2_intr_v1", index), _pattern(raw, "action2_intr_v2", index))
        if raw["severity"] not in _SEVERITIES:
            raise SheetError(f"row {index}: unknown severity {raw['severity']!r}")
        return SheetRow(
            row=int(raw["row"]),
            xid=xid,
            unit=str(raw["unit"]),
            patterns=(p1, p2),
            error_status=None if status is None else frozenset(status),
            action=action,
            action2_patterns=a2,
            action2=action2,
            investigatory=str(raw["investigatory"]),
            severity=raw["severity"],
            hw_sw=str(raw["hw_sw"]),
            local_remote=str(raw["local_remote"]),
            source=str(raw["source"]),
            masks=(_Mask.of(p1), _Mask.of(p2)),
            action2_masks=None if a2 is None else (_Mask.of(a2[0]), _Mask.of(a2[1])),
        )
    except KeyError as exc:
        raise SheetError(f"row {index}: missing field {exc}") from exc


def load_sheet(text: str) -> tuple[SheetRow, ...]:
    """Parse and check the sheet's JSON text (raises :class:`SheetError`)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SheetError(f"nvlink5_decode.json is not JSON: {exc}") from exc
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise SheetError("nvlink5_decode.json has no rows")
    out = tuple(_row(r, i) for i, r in enumerate(rows, 1))
    if [r.row for r in out] != list(range(1, len(out) + 1)):
        raise SheetError("nvlink5_decode.json rows must be numbered 1..n in sheet order")
    return out


@cache
def sheet() -> tuple[SheetRow, ...]:
    """The packaged sheet, loaded and checked once."""
    return load_sheet(
        resources.files("gpupipe_consumers.alerts.rules").joinpath("nvlink5_decode.json").read_text()
    )


@cache
def _by_xid() -> dict[int, tuple[SheetRow, ...]]:
    out: dict[int, list[SheetRow]] = {}
    for r in sheet():
        out.setdefault(r.xid, []).append(r)
    return {k: tuple(v) for k, v in out.items()}


@cache
def _bit_field_units() -> frozenset[tuple[int, str]]:
    """(xid, unit) whose rows all list single-bit statuses: there the status is a bit field."""
    units: dict[tuple[int, str], bool] = {}
    for r in sheet():
        single = r.error_status is not None and all(s and not s & (s - 1) for s in r.error_status)
        key = (r.xid, r.unit)
        units[key] = units.get(key, True) and single
    return frozenset(k for k, v in units.items() if v)


_VERSION_RE = re.compile(r"^\s*(\d{3})\.")


def layout_for_driver(driver_version: str | None) -> int | None:
    """1 for drivers before R575, 2 from R575, ``None`` when the version is unknown or unreadable."""
    m = _VERSION_RE.match(driver_version or "")
    if m is None:
        return None
    return 2 if int(m.group(1)) >= V2_FIRST_BRANCH else 1


def _rank(action: str) -> int:
    return ACTIONS.index(action)


def _effective(row: SheetRow, layout: int, intr: int) -> tuple[str, bool]:
    masks = row.action2_masks
    if row.action2 is not None and masks is not None and masks[layout - 1].matches(intr):
        return row.action2, True
    return row.action, False


def _candidates(rows: tuple[SheetRow, ...], layout: int, intr: int) -> list[SheetRow]:
    """Rows whose IntrInfo pattern (or Action-2 pattern) for ``layout`` matches."""
    out = []
    for r in rows:
        if r.masks[layout - 1].matches(intr) or (
            r.action2_masks is not None and r.action2_masks[layout - 1].matches(intr)
        ):
            out.append(r)
    return out


def _with_status(cands: list[SheetRow], status: int | None) -> list[SheetRow] | None:
    """The row(s) the status selects among IntrInfo-matching ``cands`` (see module doc)."""
    exact = [r for r in cands if r.error_status is None or (status is not None and status in r.error_status)]
    if exact or status is None or not cands:
        return exact or None
    units = {(r.xid, r.unit) for r in cands}
    if len(units) != 1 or next(iter(units)) not in _bit_field_units():
        return None
    picked = []
    for bit in range(32):
        if status >> bit & 1:
            hit = [r for r in cands if r.error_status is not None and 1 << bit in r.error_status]
            if not hit:
                return None  # a bit the sheet does not describe: not decoded
            picked.append(hit[0])
    return picked


def _decide(rows: list[SheetRow], layout: int, intr: int, unit: str) -> Nvlink5Decode:
    named = [r for r in rows if unit in r.names(layout)]
    if named:  # two rows with one pattern and status (Xid 150): the printed name picks
        rows = named + [r for r in rows if r not in named]
    scored = sorted(((_effective(r, layout, intr), r) for r in rows), key=lambda t: -_rank(t[0][0]))
    (action, promoted), _ = scored[0]
    return Nvlink5Decode(
        rows=tuple(r for _, r in scored),
        layout=layout,
        action=action,
        action2=promoted,
        subcode=(intr >> 5) & 0x1F if layout == 1 else intr & 0x7F,
        link_down_reason=(intr >> 20) & 0x3F,
    )


def decode_nvlink5(
    xid: int,
    unit: str,
    intr_info: int | None,
    error_status: int | None,
    *,
    driver_version: str | None = None,
) -> Nvlink5Decode | None:
    """Decode one Xid 144-150 report with the sheet; ``None`` when no row matches (see module doc)."""
    rows = _by_xid().get(xid)
    if not rows or intr_info is None:
        return None
    name = _norm(unit)
    known = layout_for_driver(driver_version)
    found: list[tuple[int, list[SheetRow]]] = []
    for layout in (known,) if known is not None else (1, 2):
        selected = _with_status(_candidates(rows, layout, intr_info), error_status)
        if selected:
            found.append((layout, selected))
    if len(found) > 1:  # both layouts match: the printed unit name says which driver wrote it
        by_name = [(lay, sel) for lay, sel in found if any(name in r.names(lay) for r in sel)]
        if len(by_name) == 1:
            found = by_name
        else:
            decisions = {_decide(sel, lay, intr_info, name).action for lay, sel in found}
            if len(decisions) > 1:
                return None  # the two layouts disagree and nothing tells them apart
            found = [f for f in found if f[0] == 2]
    if not found:
        return None
    layout, selected = found[0]
    return _decide(selected, layout, intr_info, name)
