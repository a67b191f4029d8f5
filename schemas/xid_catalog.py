"""NVIDIA's XID / NVSwitch SXid catalog, pinned as package data, with lookups.

In the contract because what a code means is shared: the alerts service classifies with it, the OTLP
exporter labels log records with it.

Pure: the only input is ``xid_catalog.json`` shipped inside the contract package (read once, at
import, through ``importlib.resources``). A malformed catalog raises :class:`CatalogError` at import,
so a bad data file fails at startup rather than while an alert is being built.

What comes from NVIDIA and what is ours (see ``source.fields`` in the JSON and
``shared/reference/xid-catalog.md``):

* ``name`` (mnemonic), ``description``, ``applies_to``, ``nvidia_action`` (the catalog's "Resolution
  Bucket (Immediate Action)") and ``nvidia_investigatory`` are transcribed from NVIDIA's Xid catalog
  (reference [CAT] §2). SXids come from the Fabric Manager User Guide appendix "NVSwitch SXid Errors".
  ``nvidia_action`` holds only NVIDIA's buckets: it is ``None`` where NVIDIA gives none (162-176, every
  SXid, unknown codes).
* ``action`` (our bucket: NVIDIA's where it has one, else our reading of the text, with ``notes`` saying
  why), ``cause_class``, ``severity``, ``drain_node`` and ``runbook`` are this project's judgement.
  Codes 173-176 come from the driver's ``nverror.h`` (580.105.08-595.45.04), not yet from the catalog.

Unknown codes: :func:`lookup` never raises for an integer code. It returns a safe default flagged
``known=False``: severity ``warning`` (someone should look, but nobody is woken for a code we cannot
read), action ``CONTACT_SUPPORT`` (NVSentinel's default for codes missing from its catalog, reference §3),
cause class ``unknown`` (guessing "driver" would send the wrong team), and ``drain_node=False`` (a new
driver that adds an informational code must not drain a fleet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any, Literal

__all__ = [
    "CATALOG_DATE",
    "CATALOG_VERSION",
    "Action",
    "CatalogError",
    "CauseClass",
    "Kind",
    "Severity",
    "XidCatalog",
    "XidInfo",
    "entries",
    "lookup",
    "parse_catalog",
    "unknown_entry",
]

Kind = Literal["xid", "sxid"]


class Severity(StrEnum):
    """Our alert severity (not NVIDIA's). ``critical`` pages; ``warning`` tickets; ``info`` records."""

    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


class CauseClass(StrEnum):
    """Who most likely owns the fault; decides which team looks first.

    ``hardware_memory`` covers the GPU board itself (HBM/SRAM ECC, row remapping, on-chip units): the
    GPU is suspect. ``unknown`` is only used for codes missing from the pinned catalog.
    """

    APPLICATION = "application"
    DRIVER = "driver"
    HARDWARE_MEMORY = "hardware_memory"
    NVLINK_FABRIC = "nvlink_fabric"
    THERMAL_POWER = "thermal_power"
    BUS = "bus"
    UNKNOWN = "unknown"


class Action(StrEnum):
    """NVIDIA resolution buckets, named exactly as in the Xid catalog's "Guidance Class" sheet.

    The catalog's *immediate* buckets are the first group; ``WORKFLOW_*`` and ``XID_154`` are buckets
    whose outcome depends on context (resolved by :mod:`gpupipe_consumers.alerts.rules.classify`). The last
    group are
    buckets the catalog names as the *outcome* of a workflow (``DRAIN_AND_RESET`` from WORKFLOW_XID_48,
    ``RESTART_FM`` from WORKFLOW_XID_45, ``RUN_DCGMEUD`` / ``RUN_FIELDDIAG`` from WORKFLOW_XID_13/31/48,
    ``DRAIN_P2P`` from Xid 154's recovery action); ``classify`` may return them. ``BUS_RESET`` and
    ``SYSTEM_REBOOT`` are NVML recovery actions (R615+) no catalog bucket names.
    """

    RESTART_APP = "RESTART_APP"
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"
    RESTART_VM = "RESTART_VM"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"
    CHECK_UVM = "CHECK_UVM"
    UPDATE_SWFW = "UPDATE_SWFW"
    IGNORE = "IGNORE"
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"
    XID_154 = "XID_154"
    DRAIN_AND_RESET = "DRAIN_AND_RESET"
    DRAIN_P2P = "DRAIN_P2P"
    RESTART_FM = "RESTART_FM"
    RUN_DCGMEUD = "RUN_DCGMEUD"
    RUN_FIELDDIAG = "RUN_FIELDDIAG"
    # NVML's recovery actions that no catalog bucket names (driver R615+: nvmlGpuRecoveryAction_t 6, 7)
    BUS_RESET = "BUS_RESET"
    SYSTEM_REBOOT = "SYSTEM_REBOOT"


class CatalogError(ValueError):
    """The packaged catalog is malformed (bad JSON, unknown enum value, duplicate code, missing field)."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One catalog row (or the safe default for an unknown code, with ``known=False``)."""

    code: int
    kind: Kind
    name: str
    description: str
    cause_class: CauseClass
    nvidia_action: Action | None
    """NVIDIA's immediate-action bucket, unchanged; ``None`` where NVIDIA gives none."""
    severity: Severity
    drain_node: bool
    runbook: str
    known: bool = True
    action: Action | None = None
    """Our bucket when NVIDIA has none (see :attr:`bucket`)."""
    nvidia_investigatory: str = ""
    applies_to: tuple[str, ...] = ()
    fatality: str = ""
    """SXids only: ``non_fatal`` / ``fatal`` / ``always_fatal`` / ``notable`` (Fabric Manager guide class)."""
    notes: str = ""

    @property
    def bucket(self) -> Action:
        """The action the classifier starts from: NVIDIA's bucket, else ours."""
        bucket = self.nvidia_action if self.nvidia_action is not None else self.action
        assert bucket is not None  # guaranteed by _entry / unknown_entry
        return bucket


@dataclass(frozen=True, slots=True)
class XidCatalog:
    version: str
    date: str
    xids: dict[int, XidInfo]
    sxids: dict[int, XidInfo]

    def table(self, kind: Kind) -> dict[int, XidInfo]:
        if kind == "xid":
            return self.xids
        if kind == "sxid":
            return self.sxids
        raise ValueError(f"kind must be 'xid' or 'sxid', not {kind!r}")


_REQUIRED = (
    "code",
    "name",
    "description",
    "cause_class",
    "nvidia_action",
    "severity",
    "drain_node",
    "runbook",
)


def _entry(raw: Any, kind: Kind, index: int) -> XidInfo:
    where = f"{kind}s[{index}]"
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected an object")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise CatalogError(f"{where}: missing {', '.join(missing)}")
    code = raw["code"]
    if not isinstance(code, int) or isinstance(code, bool) or code <= 0:
        raise CatalogError(f"{where}: code must be a positive integer, got {code!r}")
    if not isinstance(raw["drain_node"], bool):
        raise CatalogError(f"{kind} {code}: drain_node must be a boolean")
    for text_field in ("name", "description", "runbook"):
        if not isinstance(raw[text_field], str) or not raw[text_field].strip():
            raise CatalogError(f"{kind} {code}: {text_field} must be a non-empty string")
    try:
        cause = CauseClass(raw["cause_class"])
        nvidia = None if raw["nvidia_action"] is None else Action(raw["nvidia_action"])
        ours = None if raw.get("action") is None else Action(raw["action"])
        severity = Severity(raw["severity"])
    except ValueError as exc:
        raise CatalogError(f"{kind} {code}: {exc}") from exc
    if nvidia is None and ours is None:
        raise CatalogError(f"{kind} {code}: nvidia_action is null: give our bucket in 'action'")
    if nvidia is not None and ours is not None:
        raise CatalogError(f"{kind} {code}: 'action' is only for rows where NVIDIA gives no bucket")
    if cause is CauseClass.UNKNOWN:
        raise CatalogError(f"{kind} {code}: cause_class 'unknown' is reserved for codes not in the catalog")
    return XidInfo(
        code=code,
        kind=kind,
        name=raw["name"],
        description=raw["description"],
        cause_class=cause,
        nvidia_action=nvidia,
        action=ours,
        severity=severity,
        drain_node=raw["drain_node"],
        runbook=raw["runbook"],
        nvidia_investigatory=str(raw.get("nvidia_investigatory", "")),
        applies_to=tuple(raw.get("applies_to", ())),
        fatality=str(raw.get("fatality", "")),
        notes=str(raw.get("notes", "")),
    )


def parse_catalog(text: str) -> XidCatalog:
    """Parse and validate catalog JSON text. Raises :class:`CatalogError` on any defect."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"catalog is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise CatalogError("catalog must be a JSON object")
    for key in ("catalog_version", "catalog_date", "source", "xids", "sxids"):
        if key not in doc:
            raise CatalogError(f"catalog is missing top-level {key!r}")
    tables: dict[Kind, dict[int, XidInfo]] = {"xid": {}, "sxid": {}}
    for kind in ("xid", "sxid"):
        rows = doc[f"{kind}s"]
        if not isinstance(rows, list):
            raise CatalogError(f"{kind}s must be a list")
        for i, raw in enumerate(rows):
            info = _entry(raw, kind, i)
            if info.code in tables[kind]:
                raise CatalogError(f"duplicate {kind} code {info.code}")
            tables[kind][info.code] = info
    return XidCatalog(
        version=str(doc["catalog_version"]),
        date=str(doc["catalog_date"]),
        xids=tables["xid"],
        sxids=tables["sxid"],
    )


def _load_packaged() -> XidCatalog:
    text = resources.files(__package__).joinpath("xid_catalog.json").read_text(encoding="utf-8")
    return parse_catalog(text)


_CATALOG = _load_packaged()

CATALOG_VERSION: str = _CATALOG.version
CATALOG_DATE: str = _CATALOG.date


def unknown_entry(code: int, kind: Kind = "xid") -> XidInfo:
    """The safe default :func:`lookup` returns for a code missing from the catalog (``known=False``)."""
    label = "XID" if kind == "xid" else "SXid"
    return XidInfo(
        code=code,
        kind=kind,
        name=f"UNKNOWN_{label.upper()}",
        description=f"{label} {code} is not in the pinned catalog {CATALOG_VERSION} ({CATALOG_DATE})",
        cause_class=CauseClass.UNKNOWN,
        nvidia_action=None,
        action=Action.CONTACT_SUPPORT,
        severity=Severity.WARNING,
        drain_node=False,
        runbook=(
            f"{label} {code} is not in our pinned catalog: look it up in NVIDIA's current Xid catalog"
            + (" or the Fabric Manager guide" if kind == "sxid" else "")
            + ", check the driver version on the node, collect nvidia-bug-report.sh and open a support"
            " case. Drain by hand if the GPU misbehaves; then add the code to xid_catalog.json."
        ),
        known=False,
    )


def lookup(code: int, kind: Kind = "xid") -> XidInfo:
    """Catalog row for ``code``; for a code not in the catalog, the safe default with ``known=False``."""
    info = _CATALOG.table(kind).get(code)
    return info if info is not None else unknown_entry(code, kind)


def entries(kind: Kind = "xid") -> tuple[XidInfo, ...]:
    """All catalog rows of one kind, ordered by code."""
    table = _CATALOG.table(kind)
    return tuple(table[c] for c in sorted(table))
