"""Context-dependent XID/SXid classification: NVIDIA's catalog plus the workflows it describes.

Pure: no clocks, no I/O. Time is the event's ``ts_ms``; context is a small per-GPU history
(:class:`GpuXidHistory`) and an optional snapshot of the GPU's memory health (:class:`GpuHealth`),
both passed in by the caller.

Typical use in the alerts consumer, one history per GPU UUID::

    history = histories.setdefault(gpu_uuid, GpuXidHistory())
    result = classify(event, history, health)   # then history.record(event)
    # or: result = observe(event, history, health)  (classify, then record)

``classify`` does not mutate the history. It ignores a history record identical to the event being
classified, so recording before or after classifying gives the same answer.

References in docstrings use the tags of ``shared/reference/xid-catalog.md``: [CAT] NVIDIA's Xid
catalog (§1 buckets, §2 table, "Guidance Class" sheet), [MEM] NVIDIA's GPU memory error management
guide, [SRC] the open GPU kernel modules' Xid formats (§4), [NVS] NVSentinel (§3). SXids: NVIDIA
Fabric Manager User Guide, appendix "NVSwitch SXid Errors" (see ``xid_catalog.json``).

Rules (the ``rule`` field of :class:`Classification` names the one that decided):

* ``fallen_off_bus`` / ``gpu_lost`` / ``xid79`` / ``xid79.recurring``: treated as Xid 79.
* ``app_fault.single`` / ``app_fault.repeat_distinct_processes``: Xid 13/31/43 (WORKFLOW_XID_13/31).
* ``xid45.sympathetic`` / ``xid45.solo``: WORKFLOW_XID_45.
* ``ecc.*``: Xid 48 (and 171/172), 63, 64 with row-remapper state (WORKFLOW_XID_48, [MEM]).
* ``containment.*``: Xid 94/95 with the RST / D-RST flags of the message ([SRC]).
* ``xid74.*``: NVLink register decode (WORKFLOW_NVLINK_ERR).
* ``gsp.*``: Xid 119/120, escalating when they recur.
* ``nvlink5.*``: Xid 144-150 Fatal/Nonfatal token (WORKFLOW_NVLINK5_ERR, XID_154_EVAL).
* ``xid154.*``: recovery action text of Xid 154 (XID_154).
* ``sxid.catalog`` / ``sxid.unknown``; ``catalog`` (no workflow: the catalog row as is); ``unknown``.
* Modifiers appended as ``+remap_failure`` and ``+recovery_action`` (from :class:`GpuHealth`).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from consumers.alerts.catalog import (
    CATALOG_VERSION,
    Action,
    CauseClass,
    Severity,
    lookup,
    unknown_entry,
)

__all__ = [
    "DEFAULT_CONFIG",
    "Classification",
    "ClassifyConfig",
    "Containment",
    "EventKind",
    "FaultEvent",
    "GpuHealth",
    "GpuXidHistory",
    "Nvlink5Error",
    "NvlinkError",
    "RecoveryChange",
    "XidRecord",
    "classify",
    "decode_nvlink_registers",
    "observe",
    "parse_containment",
    "parse_nvlink5",
    "parse_nvlink_error",
    "parse_recovery_action",
    "recovery_action_from_nvml",
]

EventKind = Literal["xid", "sxid", "fallen_off_bus", "gpu_lost", "unknown"]
_EVENT_KINDS = ("xid", "sxid", "fallen_off_bus", "gpu_lost", "unknown")
_GPU_GONE_KINDS = ("fallen_off_bus", "gpu_lost")
_GPU_KINDS = ("xid", *_GPU_GONE_KINDS)

MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
_MAX_MESSAGE_CHARS = 512


# --------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One fault report for one GPU (or, for ``sxid``, one NVSwitch).

    ``kind``: ``xid`` / ``sxid`` (code required), ``fallen_off_bus`` (the kernel printed "GPU has fallen
    off the bus" without an Xid) or ``gpu_lost`` (NVML returned GPU_IS_LOST); the last two are treated as
    Xid 79 and their ``code`` is ignored. ``unknown`` mirrors the Avro ``XidKind`` default for symbols
    this consumer does not know yet; it gets the safe default. ``pid`` / ``process_name`` come from the
    kernel line (the driver prints ``pid='<unknown>'`` / ``name=<unknown>`` when it has none: pass
    ``None``). ``message`` is the text after the code (or the whole line); parsers search it, so either
    works. The fields map one to one onto the ``XidEvent`` Avro record (``timestamp_ms`` -> ``ts_ms``,
    ``xid`` -> ``code``).
    """

    kind: EventKind
    ts_ms: int
    code: int | None = None
    pid: int | None = None
    process_name: str | None = None
    message: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _EVENT_KINDS:
            raise ValueError(f"kind must be one of {_EVENT_KINDS}, not {self.kind!r}")
        if self.kind in ("xid", "sxid") and self.code is None:
            raise ValueError(f"a {self.kind} event needs a code")

    @property
    def effective_code(self) -> int:
        """The code rules key on: 79 for ``fallen_off_bus`` / ``gpu_lost``, 0 for a code-less ``unknown``."""
        if self.kind in _GPU_GONE_KINDS:
            return 79
        return self.code if self.code is not None else 0


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """Latest known memory-health state of the GPU; ``None`` means "not known" (never "false" or 0).

    ``remap_pending`` / ``remap_failure`` / ``*_remapped_rows``: ``nvmlDeviceGetRemappedRows``.
    ``sram_threshold_exceeded``: the SRAM error threshold flag WORKFLOW_XID_48 asks to check [CAT].
    ``recovery_action``: NVML field ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (0 none, 1 GPU reset,
    2 node reboot, 3 drain P2P, 4 drain and reset; see nvml-telemetry.md).
    """

    remap_pending: bool | None = None
    remap_failure: bool | None = None
    uncorrectable_remapped_rows: int | None = None
    correctable_remapped_rows: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_aggregate: int | None = None
    ecc_sbe_aggregate: int | None = None
    sram_threshold_exceeded: bool | None = None
    recovery_action: int | None = None


_NO_HEALTH = GpuHealth()


@dataclass(frozen=True, slots=True)
class ClassifyConfig:
    """Windows and thresholds. Defaults follow the reference where it gives numbers, else are ours."""

    app_fault_window_ms: int = HOUR_MS
    """Xid 13/31/43 look-back when counting distinct processes (ours; [CAT] says "repeat")."""
    app_fault_distinct_processes: int = 3
    """Distinct processes (this one included) that turn Xid 13/31/43 into a hardware suspicion."""
    correlation_window_ms: int = 10 * MINUTE_MS
    """Xid 48 "with 63 or 64" (WORKFLOW_XID_48) and 74 "seen with other Xid/SXid" (ours)."""
    recovery_link_window_ms: int = MINUTE_MS
    """How close an Xid 154 must be to the Xid it speaks for (the driver emits it within ~1 s)."""
    solo_window_ms: int = MINUTE_MS
    """Xid 45 counts as "solo" when no other Xid is this close (WORKFLOW_XID_45)."""
    recurrence_window_ms: int = DAY_MS
    """How far back a previous incident of the same fault makes this one a recurrence."""
    incident_gap_ms: int = 10 * MINUTE_MS
    """Reports closer than this belong to one incident (bursts, kmsg + NVML duplicates); a later report
    means the fault came back, e.g. after the reset or reboot that the first one asked for."""
    nvlink_same_link_limit: int = 2
    """Xid 74 ECC/parity bits: report a bug when seen *more than* this many times on one link [CAT]."""


DEFAULT_CONFIG = ClassifyConfig()


# -------------------------------------------------------------------------------------------- history


@dataclass(frozen=True, slots=True)
class XidRecord:
    """What the history keeps of an event (``code`` is 79 for fallen_off_bus / gpu_lost)."""

    code: int
    kind: EventKind
    ts_ms: int
    pid: int | None = None
    process_name: str | None = None
    message: str = ""


def _record_of(event: FaultEvent) -> XidRecord:
    return XidRecord(
        code=event.effective_code,
        kind=event.kind,
        ts_ms=event.ts_ms,
        pid=event.pid,
        process_name=_clean_name(event.process_name),
        message=event.message[:_MAX_MESSAGE_CHARS],
    )


class GpuXidHistory:
    """Recent fault records of one GPU, ordered by ``ts_ms`` and bounded two ways.

    Records older than ``horizon_ms`` before the newest record are dropped, and at most ``max_records``
    are kept (oldest dropped first). Recording the same event twice (same code, kind, time, pid and
    message, e.g. after a consumer rebalance replays it) keeps one record.
    """

    __slots__ = ("_records", "horizon_ms", "max_records")

    def __init__(self, horizon_ms: int = DAY_MS, max_records: int = 256) -> None:
        if horizon_ms <= 0 or max_records <= 0:
            raise ValueError("horizon_ms and max_records must be positive")
        self.horizon_ms = horizon_ms
        self.max_records = max_records
        self._records: list[XidRecord] = []

    def record(self, event: FaultEvent) -> None:
        rec = _record_of(event)
        lo = bisect.bisect_left(self._records, rec.ts_ms, key=_ts)
        hi = bisect.bisect_right(self._records, rec.ts_ms, key=_ts)
        if rec in self._records[lo:hi]:
            return
        self._records.insert(hi, rec)
        self._prune()

    def records(self) -> tuple[XidRecord, ...]:
        return tuple(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def _prune(self) -> None:
        cutoff = self._records[-1].ts_ms - self.horizon_ms
        start = bisect.bisect_left(self._records, cutoff, key=_ts)
        start = max(start, len(self._records) - self.max_records)
        if start > 0:
            del self._records[:start]


def _ts(rec: XidRecord) -> int:
    return rec.ts_ms


# ------------------------------------------------------------------------------------------- output


@dataclass(frozen=True, slots=True)
class Classification:
    """The decision for one event; enum fields mirror the alert schema's enums.

    ``codes``: the event's code first, then codes from the history that shaped the decision.
    ``action``: what to do now (resolved from NVIDIA's bucket; ``nvidia_action`` is the catalog's
    immediate bucket for the code, unchanged). ``rule``: stable id of the deciding rule.
    """

    codes: tuple[int, ...]
    kind: EventKind
    name: str
    severity: Severity
    cause_class: CauseClass
    action: Action
    nvidia_action: Action
    drain_node: bool
    reason: str
    runbook: str
    known: bool
    rule: str
    catalog_version: str = field(default=CATALOG_VERSION)

    @property
    def code(self) -> int:
        return self.codes[0]


# ------------------------------------------------------------------------------------ message parsers


@dataclass(frozen=True, slots=True)
class Containment:
    """Xid 94/95 body: ``<Contained|Uncontained>: <unit> (...). RST: <Yes|No>, D-RST: <Yes|No>`` [SRC]."""

    contained: bool
    unit: str
    gpu_reset_required: bool | None
    drain_and_reset_required: bool | None


_CONTAINMENT_RE = re.compile(r"\b(?P<kind>Uncontained|Contained):\s*(?P<unit>[^(.]*)", re.IGNORECASE)
_RST_RE = re.compile(r"(?<![-\w])RST:\s*(?P<v>Yes|No)\b", re.IGNORECASE)
_DRST_RE = re.compile(r"\bD-RST:\s*(?P<v>Yes|No)\b", re.IGNORECASE)


def parse_containment(message: str) -> Containment | None:
    m = _CONTAINMENT_RE.search(message)
    if m is None:
        return None
    rst = _RST_RE.search(message)
    drst = _DRST_RE.search(message)
    return Containment(
        contained=m.group("kind").lower() == "contained",
        unit=m.group("unit").strip(),
        gpu_reset_required=None if rst is None else rst.group("v").lower() == "yes",
        drain_and_reset_required=None if drst is None else drst.group("v").lower() == "yes",
    )


@dataclass(frozen=True, slots=True)
class RecoveryChange:
    """Xid 154 body: ``GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)``."""

    from_value: int
    from_name: str
    to_value: int
    to_name: str
    action: Action | None
    """``to`` mapped to an action; ``None`` when neither its name nor its value is recognised."""


_RECOVERY_RE = re.compile(
    r"recovery action changed from\s+(?P<fv>0x[0-9a-f]+|\d+)\s*(?:\((?P<fn>[^)]*)\))?"
    r"\s*to\s+(?P<tv>0x[0-9a-f]+|\d+)\s*(?:\((?P<tn>[^)]*)\))?",
    re.IGNORECASE,
)
# [CAT] Xid 154: the expected texts are "None", "Drain P2P", "Drain and Reset", "GPU Reset Required",
# "Node Reboot Required".
_RECOVERY_TEXT = {
    "none": Action.IGNORE,
    "drain p2p": Action.DRAIN_P2P,
    "drain and reset": Action.DRAIN_AND_RESET,
    "gpu reset required": Action.RESET_GPU,
    "node reboot required": Action.RESTART_BM,
}
# NVML_GPU_RECOVERY_ACTION_* values (nvml-telemetry.md): 0 NONE, 1 GPU_RESET, 2 NODE_REBOOT, 3 DRAIN_P2P,
# 4 DRAIN_AND_RESET; newer bindings add 6 BUS_RESET and 7 SYSTEM_REBOOT. 5 (RECOVER_IMEX_DOMAIN) has no
# bucket here and stays unmapped.
_RECOVERY_NVML = {
    0: Action.IGNORE,
    1: Action.RESET_GPU,
    2: Action.RESTART_BM,
    3: Action.DRAIN_P2P,
    4: Action.DRAIN_AND_RESET,
    6: Action.RESET_GPU,
    7: Action.RESTART_BM,
}


def recovery_action_from_nvml(value: int) -> Action | None:
    """Map an ``NVML_GPU_RECOVERY_ACTION_*`` value to an action; ``None`` if unrecognised."""
    return _RECOVERY_NVML.get(value)


def parse_recovery_action(message: str) -> RecoveryChange | None:
    m = _RECOVERY_RE.search(message)
    if m is None:
        return None
    to_value = int(m.group("tv"), 0)
    to_name = (m.group("tn") or "").strip()
    action = _RECOVERY_TEXT.get(" ".join(to_name.lower().split()))
    if action is None:
        action = recovery_action_from_nvml(to_value)
    return RecoveryChange(
        from_value=int(m.group("fv"), 0),
        from_name=(m.group("fn") or "").strip(),
        to_value=to_value,
        to_name=to_name,
        action=action,
    )


@dataclass(frozen=True, slots=True)
class NvlinkError:
    """Xid 74 body: ``NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)``."""

    link: int
    registers: tuple[int, ...]
    """The hex fields in order (the catalog expects seven); empty when the line carries none."""


_NVLINK_LINK_RE = re.compile(r"\blink\s+(?P<link>\d+)\s*(?:\((?P<regs>[^)]*)\))?", re.IGNORECASE)
_HEX_RE = re.compile(r"0x[0-9a-f]+", re.IGNORECASE)


def parse_nvlink_error(message: str) -> NvlinkError | None:
    m = _NVLINK_LINK_RE.search(message)
    if m is None:
        return None
    regs = tuple(int(h, 16) for h in _HEX_RE.findall(m.group("regs") or ""))
    return NvlinkError(link=int(m.group("link")), registers=regs)


# WORKFLOW_NVLINK_ERR [CAT]: which bits of which register (0-based: first register = 0) mean what.
_NVL_BITS: dict[str, dict[int, frozenset[int]]] = {
    "ignorable": {0: frozenset({0, 23, 30})},
    "sympathetic": {0: frozenset({1, 20}), 3: frozenset({16, 17})},
    "fabric_reset": {3: frozenset({18})},
    "ecc_parity": {
        0: frozenset({4, 5}),
        2: frozenset({0, 1, 2, 6}),
        4: frozenset({18, 19, 21, 22, 24, 25, 27, 28}),
    },
    "mechanical": {0: frozenset({8, 9, 12, 16, 17, 24, 28})},
    "marginal_si": {0: frozenset({21, 22})},
    "report_if_repeated": {0: frozenset({27, 29}), 2: frozenset({16, 17, 18, 19})},
    "not_expected": {2: frozenset({13})},
    "ecc_threshold": {4: frozenset({20, 23, 26, 29})},
}


def decode_nvlink_registers(registers: Iterable[int]) -> dict[str, list[str]]:
    """Group the set bits of Xid 74's registers by the catalog's guidance (WORKFLOW_NVLINK_ERR, [CAT]).

    Returns ``{category: ["r1.b4", ...]}`` for categories with at least one set bit; register numbers
    are 1-based as in the catalog. Bits the catalog does not describe land in ``undocumented`` (the
    catalog says: report a bug).
    """
    out: dict[str, list[str]] = {}
    for reg_index, value in enumerate(registers):
        for bit in range(value.bit_length()):
            if not value >> bit & 1:
                continue
            label = f"r{reg_index + 1}.b{bit}"
            category = next((c for c, regs in _NVL_BITS.items() if bit in regs.get(reg_index, ())), None)
            out.setdefault(category or "undocumented", []).append(label)
    return out


@dataclass(frozen=True, slots=True)
class Nvlink5Error:
    """Xid 144-150 body: ``<unit> <Fatal|Nonfatal> <XC> <injected> Link <n> (<intrInfo> <errorStatus> ..)``.

    [CAT] WORKFLOW_NVLINK5_ERR message format.
    """

    unit: str
    fatal: bool
    link: int
    intr_info: int | None
    error_status: int | None


_NVLINK5_RE = re.compile(
    r"\b(?P<unit>[A-Z][A-Z0-9_/]*)\s+(?P<sev>Fatal|Non-?fatal)\b.*?\bLink\s+(?P<link>-?\d+)"
    r"(?:\s*[(\[]\s*(?P<intr>0x[0-9a-fA-F]+)(?:\s+(?P<status>0x[0-9a-fA-F]+))?)?",
    re.IGNORECASE,
)


def parse_nvlink5(message: str) -> Nvlink5Error | None:
    m = _NVLINK5_RE.search(message)
    if m is None:
        return None
    return Nvlink5Error(
        unit=m.group("unit").upper(),
        fatal=m.group("sev").lower() == "fatal",
        link=int(m.group("link")),
        intr_info=int(m.group("intr"), 16) if m.group("intr") else None,
        error_status=int(m.group("status"), 16) if m.group("status") else None,
    )


# ------------------------------------------------------------------------------------------- helpers

# Higher = more disruptive / more human work. Used to combine and escalate decisions.
_ACTION_RANK = {
    Action.IGNORE: 0,
    Action.WORKFLOW_XID_45: 0,
    Action.RESTART_APP: 1,
    Action.CHECK_UVM: 1,
    Action.UPDATE_SWFW: 1,
    Action.RESTART_FM: 2,
    Action.DRAIN_P2P: 2,
    Action.XID_154: 2,
    Action.WORKFLOW_NVLINK5_ERR: 2,
    Action.RESTART_VM: 3,
    Action.RESET_GPU: 3,
    Action.WORKFLOW_XID_48: 4,
    Action.WORKFLOW_NVLINK_ERR: 4,
    Action.DRAIN_AND_RESET: 4,
    Action.RESTART_BM: 5,
    Action.CHECK_MECHANICALS: 5,
    Action.RUN_DCGMEUD: 5,
    Action.RUN_FIELDDIAG: 5,
    Action.CONTACT_SUPPORT: 6,
}
_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
_RECOVERY_DEFAULTS = {  # (severity, drain) when an action comes from a recovery-action report
    Action.IGNORE: (Severity.INFO, False),
    Action.DRAIN_P2P: (Severity.WARNING, True),
    Action.RESET_GPU: (Severity.CRITICAL, True),
    Action.DRAIN_AND_RESET: (Severity.CRITICAL, True),
    Action.RESTART_BM: (Severity.CRITICAL, True),
}
_RUNBOOK = {
    Action.RESET_GPU: "Cordon and drain the node (or stop every process on this GPU), reset it with "
    "nvidia-smi -r -i <gpu>, reboot if the reset fails.",
    Action.DRAIN_AND_RESET: "Cordon the node and let (or make) the jobs on this GPU finish, then reset it "
    "with nvidia-smi -r -i <gpu>; reboot if the reset fails.",
    Action.RESTART_BM: "Cordon and drain the node, then reboot it (power-cycle if a GPU stays missing).",
    Action.DRAIN_P2P: "Cordon the node: stop multi-GPU (NVLink peer-to-peer) jobs on this GPU; single-GPU "
    "jobs may continue. Reset the GPU once drained.",
    Action.IGNORE: "No action required.",
}
_UNKNOWN_NAMES = frozenset({"", "<unknown>", "unknown", "n/a"})


def _clean_name(name: str | None) -> str | None:
    if name is None:
        return None
    stripped = name.strip().strip("'\"")
    return None if stripped.lower() in _UNKNOWN_NAMES else stripped


def _fmt_ms(ms: int) -> str:
    if ms % HOUR_MS == 0:
        return f"{ms // HOUR_MS}h"
    if ms % MINUTE_MS == 0:
        return f"{ms // MINUTE_MS}min"
    if ms % 1000 == 0:
        return f"{ms // 1000}s"
    return f"{ms}ms"


def _who(pid: int | None, name: str | None) -> str:
    name = _clean_name(name)
    if pid is not None and name:
        return f"pid {pid} ({name})"
    if pid is not None:
        return f"pid {pid}"
    return name or "an unknown process"


class _Ctx:
    """The event, its catalog row and the history seen without the event itself."""

    __slots__ = ("cfg", "code", "event", "health", "info", "others")

    def __init__(
        self, event: FaultEvent, history: GpuXidHistory | None, health: GpuHealth, cfg: ClassifyConfig
    ) -> None:
        self.event = event
        self.code = event.effective_code
        self.health = health
        self.cfg = cfg
        if event.kind == "unknown":
            self.info = unknown_entry(self.code, "xid")
        else:
            self.info = lookup(self.code, "sxid" if event.kind == "sxid" else "xid")
        own = _record_of(event)
        self.others: tuple[XidRecord, ...] = (
            tuple(r for r in history.records() if r != own) if history is not None else ()
        )

    def gpu_records(self) -> Iterable[XidRecord]:
        return (r for r in self.others if r.kind in _GPU_KINDS)

    def before(self, codes: Iterable[int], window_ms: int) -> list[XidRecord]:
        """GPU records with one of ``codes`` in ``[ts - window, ts]``."""
        wanted = frozenset(codes)
        now = self.event.ts_ms
        return [r for r in self.gpu_records() if r.code in wanted and now - window_ms <= r.ts_ms <= now]

    def around(self, codes: Iterable[int] | None, window_ms: int) -> list[XidRecord]:
        """Records within ``window_ms`` either side: with ``codes``, GPU records with those codes; with
        ``codes=None``, any GPU or SXid record."""
        wanted = None if codes is None else frozenset(codes)
        now = self.event.ts_ms
        return [
            r
            for r in self.others
            if abs(r.ts_ms - now) <= window_ms
            and r.kind != "unknown"
            and (wanted is None or (r.code in wanted and r.kind in _GPU_KINDS))
        ]

    def prior_incidents(self, codes: Iterable[int]) -> int:
        """Earlier incidents of these codes within the recurrence window, not counting the current one.

        Reports closer than ``incident_gap_ms`` to the next one are one incident, so a burst (or the same
        fault seen by kmsg and NVML) is not a recurrence.
        """
        times = sorted((r.ts_ms for r in self.before(codes, self.cfg.recurrence_window_ms)), reverse=True)
        incidents, later = 0, self.event.ts_ms
        for t in times:
            if later - t >= self.cfg.incident_gap_ms:
                incidents += 1
            later = t
        return incidents

    def result(
        self,
        rule: str,
        reason: str,
        *,
        action: Action | None = None,
        severity: Severity | None = None,
        drain: bool | None = None,
        cause: CauseClass | None = None,
        runbook: str | None = None,
        related: Iterable[int] = (),
    ) -> Classification:
        info = self.info
        codes = [self.code]
        for c in related:
            if c not in codes:
                codes.append(c)
        return Classification(
            codes=tuple(codes),
            kind=self.event.kind,
            name=info.name,
            severity=severity if severity is not None else info.severity,
            cause_class=cause if cause is not None else info.cause_class,
            action=action if action is not None else info.nvidia_action,
            nvidia_action=info.nvidia_action,
            drain_node=drain if drain is not None else info.drain_node,
            reason=reason,
            runbook=runbook if runbook is not None else info.runbook,
            known=info.known,
            rule=rule,
        )

    def label(self) -> str:
        kind = "SXid" if self.event.kind == "sxid" else "XID"
        return f"{kind} {self.code} ({self.info.name})"


# --------------------------------------------------------------------------------------------- rules


def _catalog_default(ctx: _Ctx) -> Classification:
    """No workflow for this code: the catalog row as is ([CAT] §2 immediate action)."""
    info = ctx.info
    return ctx.result(
        "catalog",
        f"{ctx.label()}: {info.description}. NVIDIA's immediate action is {info.nvidia_action.value}"
        + (f" (investigate: {info.nvidia_investigatory})" if info.nvidia_investigatory else "")
        + ".",
    )


def _unknown(ctx: _Ctx) -> Classification:
    """Code missing from the pinned catalog: the safe default of :func:`catalog.lookup`."""
    kind = "SXid" if ctx.event.kind == "sxid" else "XID"
    return ctx.result(
        "sxid.unknown" if ctx.event.kind == "sxid" else "unknown",
        f"{kind} {ctx.code} is not in the pinned catalog {CATALOG_VERSION}: safe default (warning, "
        "CONTACT_SUPPORT, no automatic drain) until someone reads NVIDIA's current documentation for it.",
    )


def _gpu_gone(ctx: _Ctx) -> Classification:
    """Xid 79 and its non-Xid forms ([CAT] §2 Xid 79: RESTART_BM, investigate CONTACT_SUPPORT).

    ``fallen_off_bus``: the kernel's multi-line "GPU has fallen off the bus" message without an Xid
    number (reference §3, NVSentinel issue #155); ``gpu_lost``: NVML reports the GPU lost. All three are
    one fault. A new incident after an earlier one (more than ``incident_gap_ms`` apart, within
    ``recurrence_window_ms``) means the reboot did not fix it: CONTACT_SUPPORT.
    """
    ev = ctx.event
    source = {
        "fallen_off_bus": 'the kernel reported "GPU has fallen off the bus" (no Xid number)',
        "gpu_lost": "NVML reports the GPU as lost",
        "xid": "Xid 79: the GPU is no longer reachable over PCIe",
    }[ev.kind]
    prior = ctx.prior_incidents([79])
    common = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.BUS)
    if prior:
        return ctx.result(
            "xid79.recurring",
            f"{source}, and it already happened {prior} earlier time(s) on this GPU in the last "
            f"{_fmt_ms(ctx.cfg.recurrence_window_ms)}: rebooting did not fix it; likely hardware (GPU, "
            "riser, PCIe slot, power). [CAT] Xid 79 investigatory action: CONTACT_SUPPORT.",
            action=Action.CONTACT_SUPPORT,
            related=[79],
            runbook="Cordon and drain the node, keep it out of service, collect BMC/SEL and PCIe AER logs "
            "and nvidia-bug-report.sh, and open an RMA/support case. Reseating the GPU may be tried once.",
            **common,
        )
    rule = {"xid": "xid79", "fallen_off_bus": "fallen_off_bus", "gpu_lost": "gpu_lost"}[ev.kind]
    return ctx.result(
        rule,
        f"{source}. [CAT] Xid 79: often a PCIe link failure, sometimes failing GPU hardware or a driver "
        "issue; immediate action RESTART_BM and the node should be drained.",
        action=Action.RESTART_BM,
        **common,
    )


_APP_FAULT_CODES = (13, 31, 43)


def _app_fault(ctx: _Ctx) -> Classification:
    """Xid 13/31/43: the job's bug, unless many different processes hit it on this GPU.

    [CAT] WORKFLOW_XID_13 ("repeat ... diff SMs: RUN_DCGMEUD (possible HW issue); if pass
    RUN_FIELDDIAGS; solo, no burst: CHECK_APP/CUDA") and WORKFLOW_XID_31 ("repeat MMU faults to same GPU:
    RUN_DCGMEUD (possible HW issue); ... to diff GPU: CHECK_APP/CUDA"). Xid 43: "GPU remains in a healthy
    state ... user application error" (catalog action IGNORE). We count distinct processes reporting any
    of 13/31/43 on this GPU in ``app_fault_window_ms``; at ``app_fault_distinct_processes`` or more the
    GPU, not the code, is the common factor. One process repeating stays an application fault.
    """
    ev, cfg = ctx.event, ctx.cfg
    keys: dict[object, str] = {}
    records = ctx.before(_APP_FAULT_CODES, cfg.app_fault_window_ms)
    for r in [*records, _record_of(ev)]:
        key: object = ("pid", r.pid) if r.pid is not None else ("name", r.process_name)
        if r.pid is None and r.process_name is None:
            continue  # unattributable: cannot tell whether it is another process
        keys.setdefault(key, _who(r.pid, r.process_name))
    distinct = len(keys)
    window = _fmt_ms(cfg.app_fault_window_ms)
    codes_seen = sorted({r.code for r in records} | {ctx.code})
    if distinct >= cfg.app_fault_distinct_processes:
        return ctx.result(
            "app_fault.repeat_distinct_processes",
            f"XID {ctx.code} seen on this GPU from {distinct} different processes within {window} "
            f"({', '.join(keys.values())}; codes {', '.join(map(str, codes_seen))}): likely hardware, not "
            "one application. [CAT] WORKFLOW_XID_13/31: repeats on the same GPU -> RUN_DCGMEUD, then field "
            "diagnostics. (One job crash-looping under new pids looks the same: check whether it also "
            "fails on other GPUs.)",
            action=Action.RUN_DCGMEUD,
            severity=Severity.CRITICAL,
            drain=True,
            cause=CauseClass.HARDWARE_MEMORY,
            related=[c for c in codes_seen if c != ctx.code],
            runbook="Cordon and drain the node; run DCGM diagnostics on this GPU (dcgmi diag -r 3, or the "
            "DCGM EUD); if they pass, run NVIDIA field diagnostics; on any failure open an RMA/support case. "
            "If the same jobs also fault on other GPUs, hand it back to the job owners instead.",
        )
    who = _who(ev.pid, ev.process_name)
    what = {
        13: "Graphics Engine Exception, typically an out-of-bounds access or illegal instruction in the job",
        31: "GPU memory page fault, typically an illegal address access in the job",
        43: "the job hit a software-induced fault and was stopped; the GPU stays healthy",
    }[ctx.code]
    return ctx.result(
        "app_fault.single",
        f"XID {ctx.code} from {who}: {what}. {distinct} distinct process(es) reported XID 13/31/43 on this "
        f"GPU in the last {window} (hardware suspicion at {cfg.app_fault_distinct_processes}): application "
        f"fault. [CAT] immediate action {ctx.info.nvidia_action.value}.",
        cause=CauseClass.APPLICATION,
    )


def _xid45(ctx: _Ctx) -> Classification:
    """Xid 45, WORKFLOW_XID_45 [CAT]: not solo -> IGNORE (follow the other Xid); solo -> RESTART_FM.

    "Solo" means no other Xid on this GPU within ``solo_window_ms`` either side. A solo 45 is most often a
    job killed by Ctrl-C / SIGKILL / a GPU reset ([CAT] trigger text), so it stays ``info``.
    """
    others = [
        r
        for r in ctx.around(None, ctx.cfg.solo_window_ms)
        if r.kind in _GPU_KINDS and r.code not in (45, 154)
    ]
    if others:
        codes = sorted({r.code for r in others})
        return ctx.result(
            "xid45.sympathetic",
            f"XID 45 (channels torn down) follows XID {', '.join(map(str, codes))} on this GPU within "
            f"{_fmt_ms(ctx.cfg.solo_window_ms)}: sympathetic; handle that error instead. [CAT] "
            "WORKFLOW_XID_45.",
            action=Action.IGNORE,
            severity=Severity.INFO,
            drain=False,
            related=codes,
            runbook="No action for this line; follow the alert for the other XID on this GPU.",
        )
    return ctx.result(
        "xid45.solo",
        f"XID 45 from {_who(ctx.event.pid, ctx.event.process_name)} with no other XID on this GPU within "
        f"{_fmt_ms(ctx.cfg.solo_window_ms)}: usually a job killed on purpose (Ctrl-C, SIGKILL, GPU reset). "
        "[CAT] WORKFLOW_XID_45 solo: RESTART_FM if it was not expected.",
        action=Action.RESTART_FM,
        severity=Severity.INFO,
        drain=False,
    )


def _remap_state(health: GpuHealth) -> str:
    parts = []
    if health.remap_pending is not None:
        parts.append(f"remap pending={'yes' if health.remap_pending else 'no'}")
    if health.remap_failure is not None:
        parts.append(f"remap failure={'yes' if health.remap_failure else 'no'}")
    if health.uncorrectable_remapped_rows is not None:
        parts.append(f"{health.uncorrectable_remapped_rows} rows remapped for uncorrectable errors")
    return "; ".join(parts) if parts else "row-remapper state unknown"


_RMA_RUNBOOK = (
    "Cordon and drain the node and keep this GPU out of service: the row-remap failure flag means the GPU "
    "has run out of spare rows or failed to remap (NVIDIA RMA policy). Collect nvidia-bug-report.sh and "
    "nvidia-smi -q -d ROW_REMAPPER,ECC output and open an RMA/support case."
)
_DBE_CODES = (48, 171, 172)


def _ecc_dbe(ctx: _Ctx) -> Classification:
    """Xid 48 (and its detail lines 171/172), WORKFLOW_XID_48 [CAT] with row-remapper state [MEM].

    Solo -> RESET_GPU; with Xid 63 or 64 (within ``correlation_window_ms``) -> DRAIN_AND_RESET. The
    remap-pending flag means the remap happens at the next reset [MEM], which is the same outcome as
    "with 63". Remap failure (flag or Xid 64 with the flag) -> RMA (CONTACT_SUPPORT). SRAM threshold
    exceeded -> RUN_FIELDDIAG (investigatory branch of WORKFLOW_XID_48).
    """
    health = ctx.health
    remap = ctx.around([63, 64], ctx.cfg.correlation_window_ms)
    remap_codes = sorted({r.code for r in remap})
    state = _remap_state(health)
    base = (
        f"{ctx.label()}: uncorrectable ECC error; a GPU reset or node reboot is needed to clear it"
        " ([CAT] Xid 48)"
    )
    common = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.HARDWARE_MEMORY)
    if health.remap_failure:
        return ctx.result(
            "ecc.dbe_remap_failure",
            f"{base}; row-remapper reports a remapping failure ({state}): the GPU needs RMA ([MEM] "
            "row-remapping failure flag).",
            action=Action.CONTACT_SUPPORT,
            related=remap_codes,
            runbook=_RMA_RUNBOOK,
            **common,
        )
    if remap_codes or health.remap_pending:
        why = (
            f"with XID {'/'.join(map(str, remap_codes))} on this GPU"
            if remap_codes
            else "with a remap pending"
        )
        return ctx.result(
            "ecc.dbe_with_remap",
            f"{base}; {why} ({state}): drain and reset so the row remap takes effect. [CAT] WORKFLOW_XID_48: "
            "'w/ 63 or 64: DRAIN_AND_RESET'.",
            action=Action.DRAIN_AND_RESET,
            related=remap_codes,
            runbook=_RUNBOOK[Action.DRAIN_AND_RESET]
            + " Afterwards check nvidia-smi -q -d ROW_REMAPPER: pending must be No and failure No.",
            **common,
        )
    if health.sram_threshold_exceeded:
        return ctx.result(
            "ecc.dbe_sram_threshold",
            f"{base}; the SRAM error threshold flag is set: [CAT] WORKFLOW_XID_48 says run field diagnostics "
            "(RMA flow if exceeded).",
            action=Action.RUN_FIELDDIAG,
            runbook="Cordon and drain the node, reset the GPU, run NVIDIA field diagnostics; open an RMA "
            "case if they fail or the threshold flag stays set.",
            **common,
        )
    return ctx.result(
        "ecc.dbe_solo",
        f"{base}; no XID 63/64 on this GPU within {_fmt_ms(ctx.cfg.correlation_window_ms)} ({state}). "
        "[CAT] WORKFLOW_XID_48 solo: RESET_GPU.",
        action=Action.RESET_GPU,
        runbook=_RUNBOOK[Action.RESET_GPU]
        + " Then check nvidia-smi -q -d ROW_REMAPPER,ECC; an SRAM error means checking the SRAM threshold "
        "flag.",
        **common,
    )


def _remap_event(ctx: _Ctx) -> Classification:
    """Xid 63 (row remapping event; catalog IGNORE) in context: [CAT] Xid 63, WORKFLOW_XID_48, [MEM].

    Failure flag -> RMA; with an Xid 48 nearby -> DRAIN_AND_RESET; pending (flag, or the driver's
    "reset gpu to activate" text) -> reset at a convenient time (jobs may keep running [MEM]); else IGNORE.
    """
    health, msg = ctx.health, ctx.event.message
    state = _remap_state(health)
    if health.remap_failure:
        return ctx.result(
            "ecc.remap_failure",
            f"XID 63 (row remapping event) and the row-remapper reports a remapping failure ({state}): RMA "
            "([MEM] row-remapping failure flag).",
            action=Action.CONTACT_SUPPORT,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RMA_RUNBOOK,
        )
    dbe = ctx.around(_DBE_CODES, ctx.cfg.correlation_window_ms)
    if dbe:
        codes = sorted({r.code for r in dbe})
        return ctx.result(
            "ecc.remap_with_dbe",
            f"XID 63 (row remapping event) with XID {'/'.join(map(str, codes))} (uncorrectable ECC) on this "
            f"GPU within {_fmt_ms(ctx.cfg.correlation_window_ms)} ({state}). [CAT] WORKFLOW_XID_48: 'w/ 63 "
            "or 64: DRAIN_AND_RESET'.",
            action=Action.DRAIN_AND_RESET,
            severity=Severity.CRITICAL,
            drain=True,
            related=codes,
            runbook=_RUNBOOK[Action.DRAIN_AND_RESET],
        )
    pending_text = re.search(r"reset (the )?gpu to activate|pending", msg, re.IGNORECASE) is not None
    if health.remap_pending or (health.remap_pending is None and pending_text):
        source = (
            "row-remapper reports a pending remap"
            if health.remap_pending
            else "the driver says so in the line"
        )
        return ctx.result(
            "ecc.remap_pending",
            "XID 63: a memory row was marked for remapping and takes effect at the next GPU reset "
            f"({source}). Running and new jobs are unaffected until then ([MEM] remapping pending flag).",
            action=Action.RESET_GPU,
            severity=Severity.WARNING,
            drain=False,
            runbook="No urgent action. At the next convenient window drain this GPU and reset it (nvidia-smi "
            "-r) to activate the remap; reset it before migrating a live VM onto it.",
        )
    return ctx.result(
        "ecc.remap_event",
        f"XID 63 (row remapping event), no uncorrectable error nearby ({state}). [CAT] Xid 63: IGNORE.",
    )


def _remap_failure_xid(ctx: _Ctx) -> Classification:
    """Xid 64 (row remapping failure): [CAT] RESET_GPU then CONTACT_SUPPORT; flag confirms RMA [MEM]."""
    health = ctx.health
    state = _remap_state(health)
    if health.remap_failure:
        return ctx.result(
            "ecc.remap_failure",
            f"XID 64 (row remapping failure) and the row-remapper failure flag is set ({state}): the GPU "
            "needs RMA.",
            action=Action.CONTACT_SUPPORT,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RMA_RUNBOOK,
        )
    dbe = ctx.around(_DBE_CODES, ctx.cfg.correlation_window_ms)
    if dbe:
        codes = sorted({r.code for r in dbe})
        return ctx.result(
            "ecc.remap_failure_with_dbe",
            f"XID 64 (row remapping failure) with XID {'/'.join(map(str, codes))} on this GPU ({state}). "
            "[CAT] WORKFLOW_XID_48: 'w/ 63 or 64: DRAIN_AND_RESET'; then check the remap failure flag (RMA "
            "if set).",
            action=Action.DRAIN_AND_RESET,
            severity=Severity.CRITICAL,
            drain=True,
            related=codes,
        )
    return ctx.result(
        "ecc.remap_failure_xid",
        f"XID 64 (row remapping failure) ({state}). [CAT] Xid 64: RESET_GPU, then CONTACT_SUPPORT.",
        action=Action.RESET_GPU,
    )


def _containment(ctx: _Ctx) -> Classification:
    """Xid 94/95 (error containment): [CAT] 94 RESTART_APP, 95 RESET_GPU; the line's flags refine it.

    [SRC] the body ends with ``RST: <Yes|No>, D-RST: <Yes|No>``, printed from the driver's "GPU reset
    required" / "drain and reset required" flags. D-RST: Yes -> DRAIN_AND_RESET. For 94, RST: Yes ->
    RESET_GPU, but [CAT] says applications can keep running until the reset, so no drain.
    """
    c = parse_containment(ctx.event.message)
    flags = ""
    if c is not None:
        flags = (
            f" ({'contained' if c.contained else 'uncontained'} in {c.unit or 'unknown unit'}; "
            f"RST: {_yn(c.gpu_reset_required)}, D-RST: {_yn(c.drain_and_reset_required)})"
        )
    who = _who(ctx.event.pid, ctx.event.process_name)
    if c is not None and c.drain_and_reset_required:
        return ctx.result(
            f"containment.xid{ctx.code}_drain_and_reset",
            f"XID {ctx.code} from {who}{flags}: the driver asks to drain and reset the GPU (D-RST: Yes).",
            action=Action.DRAIN_AND_RESET,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RUNBOOK[Action.DRAIN_AND_RESET],
        )
    if ctx.code == 95:
        return ctx.result(
            "containment.xid95",
            f"XID 95 from {who}{flags}: uncontained memory error affecting several applications; the GPU "
            "must be reset before applications can restart. [CAT] Xid 95: RESET_GPU.",
            action=Action.RESET_GPU,
            severity=Severity.CRITICAL,
            drain=True,
        )
    if c is not None and c.gpu_reset_required:
        return ctx.result(
            "containment.xid94_reset",
            f"XID 94 from {who}{flags}: contained to that application (restart it); the driver flags that "
            "the GPU needs a reset (RST: Yes). Other applications continue until then ([CAT] Xid 94).",
            action=Action.RESET_GPU,
            severity=Severity.WARNING,
            drain=False,
            runbook="Restart the affected job. Reset the GPU (nvidia-smi -r) at the next convenient window "
            "once its jobs have finished; no need to evacuate the node now.",
        )
    return ctx.result(
        "containment.xid94",
        f"XID 94 from {who}{flags}: memory error contained to that application, which must be restarted; "
        "other applications are unaffected. [CAT] Xid 94: RESTART_APP; reset the GPU when convenient.",
        action=Action.RESTART_APP,
        severity=Severity.WARNING,
        drain=False,
    )


def _yn(value: bool | None) -> str:
    return "?" if value is None else ("Yes" if value else "No")


def _nvlink74(ctx: _Ctx) -> Classification:
    """Xid 74, WORKFLOW_NVLINK_ERR [CAT]: decode the seven hex registers of the line.

    Per the catalog: first register bits 0/23/30 ignorable; 1/20 (and fourth register 16/17) sympathetic:
    follow the other Xid/SXid, report a bug if solo; fourth register bit 18 needs a fabric reset; ECC/parity
    bits (first 4/5, third 0/1/2/6, fifth 18/19/21/22/24/25/27/28) -> report when seen more than twice on
    the same link; first 8/9/12/16/17/24/28 and marginal SI 21/22 -> check mechanical connections; fifth
    20/23/26/29 = ECC threshold only, continue operation; undocumented bits -> report a bug. Without
    registers, [CAT] Xid 74: "a GPU reset or node reboot is needed", and "if seen repeatedly and reset or
    reboot fails to clear the condition, contact your hardware vendor".
    """
    cfg = ctx.cfg
    parsed = parse_nvlink_error(ctx.event.message)
    link_txt = f" on link {parsed.link}" if parsed is not None else ""
    decoded = decode_nvlink_registers(parsed.registers) if parsed is not None else {}
    critical = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.NVLINK_FABRIC)
    if not decoded:
        prior = ctx.prior_incidents([74])
        if prior:
            return ctx.result(
                "xid74.recurring",
                f"XID 74 (NVLink error){link_txt}, no register detail; {prior} earlier incident(s) on this "
                f"GPU in the last {_fmt_ms(cfg.recurrence_window_ms)}: the reset/reboot did not clear it. "
                "[CAT] Xid 74: contact the hardware vendor.",
                action=Action.CONTACT_SUPPORT,
                related=[74],
                **critical,
            )
        return ctx.result(
            "xid74.reset",
            f"XID 74 (NVLink error){link_txt}, no register detail to decode: a GPU reset or node reboot is "
            "needed to clear it; the fault may be at the remote end of the link ([CAT] Xid 74).",
            action=Action.RESET_GPU,
            **critical,
        )
    bits = "; ".join(f"{k}: {' '.join(v)}" for k, v in decoded.items())
    head = f"XID 74 (NVLink error){link_txt}, registers decoded per [CAT] WORKFLOW_NVLINK_ERR ({bits})"
    if "undocumented" in decoded or "not_expected" in decoded:
        return ctx.result(
            "xid74.unexpected_bits",
            f"{head}: bits the catalog does not expect are set; it says report a bug.",
            action=Action.CONTACT_SUPPORT,
            **critical,
        )
    if "fabric_reset" in decoded:
        return ctx.result(
            "xid74.fabric_reset",
            f"{head}: fourth register bit 18 means a reset of the NVLink fabric is required.",
            action=Action.RESTART_BM,
            runbook="Cordon and drain the node; reset the fabric (all GPUs and NVSwitches) by rebooting the "
            "node. Check for the Xid/SXid that caused it.",
            **critical,
        )
    if "ecc_parity" in decoded:
        same_link = [
            r
            for r in ctx.before([74], cfg.recurrence_window_ms)
            if (p := parse_nvlink_error(r.message)) is not None and p.link == parsed.link
        ]
        count = len(same_link) + 1
        if count > cfg.nvlink_same_link_limit:
            return ctx.result(
                "xid74.ecc_parity_repeated",
                f"{head}: ECC/parity error, seen {count} times on this link in the last "
                f"{_fmt_ms(cfg.recurrence_window_ms)} (more than {cfg.nvlink_same_link_limit}): likely "
                "hardware; report it.",
                action=Action.CONTACT_SUPPORT,
                related=[74],
                **critical,
            )
        return ctx.result(
            "xid74.ecc_parity",
            f"{head}: ECC/parity error ({count} on this link so far): reset to clear; report if it exceeds "
            f"{cfg.nvlink_same_link_limit} on the same link.",
            action=Action.RESET_GPU,
            **critical,
        )
    if "mechanical" in decoded or "marginal_si" in decoded:
        return ctx.result(
            "xid74.mechanical",
            f"{head}: possible hardware / marginal signal integrity: check the link's mechanical connections "
            "and reseat if needed; run diagnostics if it persists.",
            action=Action.CHECK_MECHANICALS,
            runbook="Cordon and drain the node, reset the GPU to bring the link back; have the link's "
            "connections checked and reseated; run field diagnostics if it comes back; report if diagnostics "
            "pass.",
            **critical,
        )
    if "report_if_repeated" in decoded:
        prior = ctx.prior_incidents([74])
        return ctx.result(
            "xid74.repeat_bits",
            f"{head}: the catalog says report a bug if these bits repeat ({prior} earlier incident(s)).",
            action=Action.CONTACT_SUPPORT if prior else Action.RESET_GPU,
            related=[74] if prior else (),
            **critical,
        )
    if "sympathetic" in decoded:
        others = [r for r in ctx.around(None, cfg.correlation_window_ms) if r.code != 74]
        if others:
            codes = sorted({r.code for r in others})
            return ctx.result(
                "xid74.sympathetic",
                f"{head}: secondary error; XID/SXid {', '.join(map(str, codes))} seen within "
                f"{_fmt_ms(cfg.correlation_window_ms)}: follow that error's resolution.",
                action=Action.IGNORE,
                severity=Severity.WARNING,
                drain=False,
                cause=CauseClass.NVLINK_FABRIC,
                related=codes,
                runbook="Handle the other XID/SXid alert for this GPU or its NVSwitch; nothing extra for "
                "this one.",
            )
        return ctx.result(
            "xid74.sympathetic_solo",
            f"{head}: secondary-error bits seen with no other Xid/SXid: the catalog says report a bug.",
            action=Action.CONTACT_SUPPORT,
            severity=Severity.WARNING,
            drain=False,
            cause=CauseClass.NVLINK_FABRIC,
        )
    return ctx.result(
        "xid74.benign",
        f"{head}: only ignorable bits or an ECC threshold notice (no uncorrectable error): continue "
        "operation.",
        action=Action.IGNORE,
        severity=Severity.INFO,
        drain=False,
        cause=CauseClass.NVLINK_FABRIC,
        runbook="No action. If it keeps appearing, run field diagnostics to check link integrity.",
    )


def _gsp(ctx: _Ctx) -> Classification:
    """Xid 119/120 (GSP RPC timeout / GSP error), [CAT]: "A GPU reset or node power cycle may be needed if
    the error persists. If this problem reoccurs after a power cycle, follow the NVIDIA GPU Debug
    Guidelines". First incident -> RESET_GPU; a second incident -> RESTART_BM (power cycle); more ->
    CONTACT_SUPPORT. Incidents are separated by ``incident_gap_ms`` (a burst of timeouts is one).
    """
    prior = ctx.prior_incidents([119, 120])
    what = f"{ctx.label()} from {_who(ctx.event.pid, ctx.event.process_name)}: GSP firmware error or timeout"
    common = dict(severity=Severity.CRITICAL, drain=True, cause=CauseClass.DRIVER)
    if prior >= 2:
        return ctx.result(
            "gsp.persistent",
            f"{what}; {prior} earlier incidents on this GPU in the last "
            f"{_fmt_ms(ctx.cfg.recurrence_window_ms)}: it persists after resets/power cycles. [CAT] Xid "
            "119/120: follow NVIDIA's GPU debug guidelines.",
            action=Action.CONTACT_SUPPORT,
            related=[119, 120],
            runbook="Keep the node cordoned and drained; collect nvidia-bug-report.sh; check the driver "
            "version against known GSP issues; open a support case.",
            **common,
        )
    if prior == 1:
        return ctx.result(
            "gsp.recurring",
            f"{what}; it came back after an earlier incident on this GPU: power-cycle the node. [CAT] Xid "
            "119/120.",
            action=Action.RESTART_BM,
            related=[119, 120],
            runbook=_RUNBOOK[Action.RESTART_BM]
            + " If it returns after the power cycle, open a support case.",
            **common,
        )
    return ctx.result(
        "gsp.reset",
        f"{what}. [CAT] Xid 119/120: RESET_GPU; power-cycle the node if it persists.",
        action=Action.RESET_GPU,
        **common,
    )


def _latest_154(ctx: _Ctx) -> tuple[XidRecord, RecoveryChange] | None:
    for r in sorted(ctx.around([154], ctx.cfg.recovery_link_window_ms), key=_ts, reverse=True):
        change = parse_recovery_action(r.message)
        if change is not None and change.action is not None:
            return r, change
    return None


def _follow_154(ctx: _Ctx, change: RecoveryChange, rule: str, head: str) -> Classification:
    assert change.action is not None
    severity, drain = _RECOVERY_DEFAULTS.get(change.action, (Severity.WARNING, False))
    return ctx.result(
        rule,
        f"{head}; XID 154 on this GPU says the recovery action is now "
        f"'{change.to_name or hex(change.to_value)}': follow it ([CAT] XID_154 / XID_154_EVAL).",
        action=change.action,
        severity=severity,
        drain=drain,
        related=[154],
        runbook=_RUNBOOK.get(change.action, ctx.info.runbook),
    )


def _nvlink5(ctx: _Ctx) -> Classification:
    """Xid 144-150, WORKFLOW_NVLINK5_ERR [CAT]: the line names the sub-unit and says Fatal or Nonfatal.

    In the "XID 144-150 Decode" sheet, rows whose severity is Fatal or Link Fatal resolve to RESET_GPU;
    Non-fatal rows to IGNORE, or (RLW_REMAP, RLW_SRC_TRACK) to XID_154_EVAL: "If an XID 154 is seen along
    with this error, take that action. If no XID 154 present, RESTART_APP". An Xid 154 nearby always wins.
    The sheet's bit-level IntrInfo/ErrorStatus decode is not reproduced; the Fatal token is what the
    driver prints from the same decode.
    """
    parsed = parse_nvlink5(ctx.event.message)
    linked = _latest_154(ctx)
    if parsed is None:
        if linked is not None:
            return _follow_154(ctx, linked[1], "nvlink5.follow_154", f"{ctx.label()} (message not decoded)")
        return ctx.result(
            "nvlink5.undecoded",
            f"{ctx.label()}: could not read the sub-unit and Fatal/Nonfatal fields from the message; decode "
            "IntrInfo/ErrorStatus with the catalog's 'XID 144-150 Decode' sheet. An Xid 154 will state the "
            "required recovery if there is one.",
        )
    head = f"{ctx.label()}: {parsed.unit} {'Fatal' if parsed.fatal else 'Nonfatal'} on link {parsed.link}"
    if parsed.fatal:
        return ctx.result(
            "nvlink5.fatal",
            f"{head}; Fatal / Link Fatal rows of [CAT] 'XID 144-150 Decode' resolve to RESET_GPU (a "
            "link-fatal GPU is put in 'drain and reset recommended' state).",
            action=Action.RESET_GPU,
            severity=Severity.CRITICAL,
            drain=True,
            runbook=_RUNBOOK[Action.RESET_GPU]
            + " Check the peer device and the link (cables, trays) if it recurs.",
        )
    if linked is not None:
        return _follow_154(ctx, linked[1], "nvlink5.follow_154", head)
    if parsed.unit in ("RLW_REMAP", "RLW_SRC_TRACK"):
        return ctx.result(
            "nvlink5.nonfatal_eval",
            f"{head}; [CAT] XID_154_EVAL with no Xid 154 on this GPU: RESTART_APP (the job may have been "
            "stopped with Xid 45).",
            action=Action.RESTART_APP,
            severity=Severity.WARNING,
            drain=False,
            runbook="Restart the affected job. If an Xid 154 follows, do what it says.",
        )
    ber = parsed.unit.startswith("NETIR_BER")
    return ctx.result(
        "nvlink5.nonfatal",
        f"{head}; Non-fatal rows of [CAT] 'XID 144-150 Decode' resolve to IGNORE"
        + (" (investigate link signal integrity and cables if it repeats)." if ber else "."),
        action=Action.IGNORE,
        severity=Severity.INFO,
        drain=False,
        runbook="No action. If it repeats on the same link, check the link's signal integrity, cables and "
        "seating."
        if ber
        else _RUNBOOK[Action.IGNORE],
    )


def _xid154(ctx: _Ctx) -> Classification:
    """Xid 154 (GPU recovery action changed), [CAT]: follow the action the line reports.

    ``... changed from 0x0 (None) to 0x2 (Node Reboot Required)``: None -> IGNORE, Drain P2P -> DRAIN_P2P,
    Drain and Reset -> DRAIN_AND_RESET, GPU Reset Required -> RESET_GPU, Node Reboot Required ->
    RESTART_BM (an unknown text falls back to the NVML value). The Xids it speaks for are those on this
    GPU within ``recovery_link_window_ms``.
    """
    change = parse_recovery_action(ctx.event.message)
    linked = sorted(
        {
            r.code
            for r in ctx.around(None, ctx.cfg.recovery_link_window_ms)
            if r.kind in _GPU_KINDS and r.code != 154
        }
    )
    about = f" (about XID {', '.join(map(str, linked))})" if linked else ""
    if change is None or change.action is None:
        shown = f" '{change.to_name or hex(change.to_value)}'" if change is not None else ""
        return ctx.result(
            "xid154.unreadable",
            f"XID 154{about}: recovery action{shown} could not be read from the message; read the line and "
            "do what it says.",
            related=linked,
        )
    severity, drain = _RECOVERY_DEFAULTS.get(change.action, (Severity.WARNING, False))
    frm = change.from_name or hex(change.from_value)
    to = change.to_name or hex(change.to_value)
    return ctx.result(
        "xid154.recovery_action",
        f"XID 154{about}: the driver changed the GPU's required recovery from '{frm}' to '{to}'. [CAT] "
        "XID_154: follow the reported action.",
        action=change.action,
        severity=severity,
        drain=drain,
        related=linked,
        runbook=_RUNBOOK.get(change.action, ctx.info.runbook)
        + (" Then fix the underlying XID." if change.action is not Action.IGNORE else ""),
    )


_FATAL_WORD = re.compile(r"(?<![-\w])fatal\b", re.IGNORECASE)


def _sxid(ctx: _Ctx) -> Classification:
    """NVSwitch SXid: the catalog row (Fabric Manager guide class and recovery).

    An SXid missing from the catalog gets the safe default, raised to critical with a drain when the
    driver's own line says ``Fatal`` (as in ``SXid (PCI:...): 20034, Fatal, Link 48 ...``).
    """
    info = ctx.info
    if not info.known:
        if _FATAL_WORD.search(ctx.event.message):
            return ctx.result(
                "sxid.unknown_fatal",
                f"SXid {ctx.code} is not in the pinned catalog {CATALOG_VERSION}, and the NVSwitch driver "
                "marks it Fatal: NVLink traffic through this switch is likely broken.",
                severity=Severity.CRITICAL,
                drain=True,
                cause=CauseClass.NVLINK_FABRIC,
            )
        return _unknown(ctx)
    section = {
        "non_fatal": "non-fatal",
        "fatal": "fatal",
        "always_fatal": "always fatal",
        "notable": "notable",
    }
    return ctx.result(
        "sxid.catalog",
        f"SXid {ctx.code} ({info.name}): {section.get(info.fatality, info.fatality)} NVSwitch error per the "
        f"Fabric Manager guide; action {info.nvidia_action.value}.",
    )


_HANDLERS = {
    13: _app_fault,
    31: _app_fault,
    43: _app_fault,
    45: _xid45,
    48: _ecc_dbe,
    171: _ecc_dbe,
    172: _ecc_dbe,
    63: _remap_event,
    64: _remap_failure_xid,
    74: _nvlink74,
    79: _gpu_gone,
    94: _containment,
    95: _containment,
    119: _gsp,
    120: _gsp,
    154: _xid154,
    **dict.fromkeys(range(144, 151), _nvlink5),
}


# ----------------------------------------------------------------------------------- health modifiers


def _apply_remap_failure(ctx: _Ctx, result: Classification) -> Classification:
    """[MEM] row-remapping failure flag: any memory-class fault on such a GPU is an RMA case."""
    if not ctx.health.remap_failure or result.cause_class is not CauseClass.HARDWARE_MEMORY:
        return result
    if result.action is Action.CONTACT_SUPPORT and result.drain_node:
        return result
    return replace(
        result,
        action=Action.CONTACT_SUPPORT,
        severity=Severity.CRITICAL,
        drain_node=True,
        reason=result.reason + " The row-remapper also reports a remapping failure: RMA ([MEM]).",
        runbook=_RMA_RUNBOOK,
        rule=result.rule + "+remap_failure",
    )


def _apply_recovery_action(ctx: _Ctx, result: Classification) -> Classification:
    """NVML's recovery-action field ([MEM] "recovery action flag"): escalate to what the driver requires."""
    value = ctx.health.recovery_action
    if value is None or value == 0:
        return result
    required = recovery_action_from_nvml(value)
    if required is None:
        return replace(result, reason=result.reason + f" (NVML recovery action {value} is not recognised.)")
    sev, drain = _RECOVERY_DEFAULTS.get(required, (Severity.WARNING, False))
    note = f" NVML also reports the GPU's required recovery action as {required.value}."
    escalate = _ACTION_RANK[required] > _ACTION_RANK[result.action]
    return replace(
        result,
        action=required if escalate else result.action,
        severity=sev if _SEVERITY_RANK[sev] > _SEVERITY_RANK[result.severity] else result.severity,
        drain_node=result.drain_node or drain,
        reason=result.reason + note,
        runbook=_RUNBOOK.get(required, result.runbook) if escalate else result.runbook,
        rule=result.rule + "+recovery_action",
    )


# ------------------------------------------------------------------------------------------- public


def classify(
    event: FaultEvent,
    history: GpuXidHistory | None = None,
    health: GpuHealth | None = None,
    config: ClassifyConfig = DEFAULT_CONFIG,
) -> Classification:
    """Classify one fault event given this GPU's recent history and memory health. Pure; never raises
    for a well-formed event (unknown codes get the catalog's safe default, ``known=False``)."""
    ctx = _Ctx(event, history, health if health is not None else _NO_HEALTH, config)
    if event.kind == "sxid":
        return _sxid(ctx)
    if event.kind == "unknown":
        return ctx.result(
            "unknown_kind",
            f"Event of a kind this consumer does not know (code {event.code}): safe default (warning, "
            "CONTACT_SUPPORT, no automatic drain); upgrade the alerts consumer to classify it.",
        )
    handler = _HANDLERS.get(ctx.code, _catalog_default) if ctx.info.known else _unknown
    result = handler(ctx)
    result = _apply_remap_failure(ctx, result)
    return _apply_recovery_action(ctx, result)


def observe(
    event: FaultEvent,
    history: GpuXidHistory,
    health: GpuHealth | None = None,
    config: ClassifyConfig = DEFAULT_CONFIG,
) -> Classification:
    """Classify ``event``, then record it in ``history``."""
    result = classify(event, history, health, config)
    history.record(event)
    return result
