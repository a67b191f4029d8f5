"""Inputs, per-GPU history and output of the XID classifier (pure data; no rules here).

Split out of :mod:`gpupipe_consumers.alerts.rules.classify`, which re-exports every public name."""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from gpupipe_consumers.alerts.rules.catalog import (
    CATALOG_VERSION,
    Action,
    CauseClass,
    Severity,
    lookup,
)

EventKind = Literal[
    "xid", "sxid", "fallen_off_bus", "gpu_lost", "recovery_action", "gpu_unavailable", "unknown"
]
_EVENT_KINDS = ("xid", "sxid", "fallen_off_bus", "gpu_lost", "recovery_action", "gpu_unavailable", "unknown")
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
    Xid 79 and their ``code`` is ignored. ``recovery_action`` / ``gpu_unavailable``: NVML's events of the
    same names, no code (the recovery action's value is in ``message``; see
    :mod:`~gpupipe_consumers.alerts.rules.notice`). ``unknown`` mirrors the Avro ``XidKind`` default for
    symbols
    this consumer does not know yet; it gets the safe default. ``pid`` / ``process_name`` come from the
    kernel line (the driver prints ``pid='<unknown>'`` / ``name=<unknown>`` when it has none: pass
    ``None``). ``message`` is the text after the code (or the whole line); parsers search it, so either
    works. The fields map one to one onto the ``XidEvent`` Avro record (``timestamp_ms`` -> ``ts_ms``,
    ``xid`` -> ``code``). ``workload``: which workload ran on the GPU (:func:`workload_key` of the
    event's first allocation), ``None`` when unknown; Xid 13/31 hardware suspicion counts workloads,
    never pids (a crash-looping container gets a new pid per restart). ``driver_version``: the event's
    (``570.158.01``), when known; it tells which message layout an NVLink5 Xid (144-150) uses.
    """

    kind: EventKind
    ts_ms: int
    code: int | None = None
    pid: int | None = None
    process_name: str | None = None
    message: str = ""
    workload: str | None = None
    driver_version: str | None = None

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
    recovery_action: int | None = None


_NO_HEALTH = GpuHealth()


@dataclass(frozen=True, slots=True)
class ClassifyConfig:
    """Windows and thresholds. Defaults follow the reference where it gives numbers, else are ours."""

    app_fault_window_ms: int = HOUR_MS
    """Xid 13/31 look-back when counting distinct workloads (ours; [CAT] says "repeat")."""
    app_fault_distinct_workloads: int = 3
    """Distinct workloads (this one included) that turn Xid 13/31 into a hardware suspicion (a ticket to
    run diagnostics, never a drain). Xid 43 never counts: NVIDIA says the GPU stays healthy."""
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
    workload: str | None = None


def _record_of(event: FaultEvent) -> XidRecord:
    return XidRecord(
        code=event.effective_code,
        kind=event.kind,
        ts_ms=event.ts_ms,
        pid=event.pid,
        process_name=_clean_name(event.process_name),
        message=event.message[:_MAX_MESSAGE_CHARS],
        workload=event.workload,
    )


class GpuXidHistory:
    """Recent fault records of one GPU, ordered by ``ts_ms`` and bounded two ways.

    Records older than ``horizon_ms`` before the newest record are dropped, and at most ``max_records``
    are kept *per cause* (the catalog's cause class of the code: application, bus, memory, ...), oldest
    of that cause dropped first. A per-GPU cap would let a flood of one kind (a buggy job's hundreds of
    Xid 13) push out the one record of another a recurrence rule needs (the Xid 79 before a reboot that
    makes the next one a hardware case); per cause, a flood only evicts its own kind. Recording the same
    event twice (same code, kind, time, pid and message, e.g. after a consumer rebalance replays it) keeps
    one record.
    """

    __slots__ = ("_per_cause", "_records", "_resets", "horizon_ms", "max_records")

    def __init__(self, horizon_ms: int = DAY_MS, max_records: int = 256) -> None:
        if horizon_ms <= 0 or max_records <= 0:
            raise ValueError("horizon_ms and max_records must be positive")
        self.horizon_ms = horizon_ms
        self.max_records = max_records
        self._records: list[XidRecord] = []
        self._per_cause: dict[str, int] = {}
        self._resets: list[int] = []

    def record_reset(self, ts_ms: int) -> None:
        """Evidence that the GPU was reset or its node rebooted at ``ts_ms`` (from samples, an operator's
        ack, or an alert restored as ``recovered`` or ``acknowledged``): recurrence rules count incidents
        across resets, not across time."""
        if ts_ms not in self._resets:
            bisect.insort(self._resets, ts_ms)
            del self._resets[: max(0, len(self._resets) - 32)]

    def resets(self) -> tuple[int, ...]:
        return tuple(self._resets)

    def record(self, event: FaultEvent) -> None:
        rec = _record_of(event)
        lo = bisect.bisect_left(self._records, rec.ts_ms, key=_ts)
        hi = bisect.bisect_right(self._records, rec.ts_ms, key=_ts)
        if rec in self._records[lo:hi]:
            return
        self._records.insert(hi, rec)
        cause = _cause(rec.kind, rec.code)
        self._per_cause[cause] = self._per_cause.get(cause, 0) + 1
        self._prune(cause)

    def records(self) -> tuple[XidRecord, ...]:
        return tuple(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def _prune(self, cause: str) -> None:
        cutoff = self._records[-1].ts_ms - self.horizon_ms
        start = bisect.bisect_left(self._records, cutoff, key=_ts)
        if start > 0:
            for old in self._records[:start]:
                self._forget(_cause(old.kind, old.code))
            del self._records[:start]
        if self._per_cause.get(cause, 0) > self.max_records:
            # the oldest record of the same cause: the one just recorded may be it (a late event)
            i = next(i for i, r in enumerate(self._records) if _cause(r.kind, r.code) == cause)
            del self._records[i]
            self._forget(cause)

    def _forget(self, cause: str) -> None:
        left = self._per_cause[cause] - 1
        if left:
            self._per_cause[cause] = left
        else:
            del self._per_cause[cause]


@functools.lru_cache(maxsize=4096)
def _cause(kind: EventKind, code: int) -> str:
    """The bound's unit: the catalog's cause class of the code (NVSwitch SXids apart from GPU XIDs)."""
    table = "sxid" if kind == "sxid" else "xid"
    return f"{table}:{lookup(code, table).cause_class.value}"


def _ts(rec: XidRecord) -> int:
    return rec.ts_ms


# ------------------------------------------------------------------------------------------- output


@dataclass(frozen=True, slots=True)
class Classification:
    """The decision for one event; enum fields mirror the alert schema's enums.

    ``codes``: the event's code first, then codes from the history that shaped the decision (empty for
    NVML notices, which have no code).
    ``action``: what to do now (resolved from NVIDIA's bucket; ``nvidia_action`` is the catalog's
    immediate bucket for the code, unchanged). ``rule``: stable id of the deciding rule.
    """

    codes: tuple[int, ...]
    kind: EventKind
    name: str
    severity: Severity
    cause_class: CauseClass
    action: Action
    nvidia_action: Action | None
    drain_node: bool
    reason: str
    runbook: str
    known: bool
    rule: str
    catalog_version: str = field(default=CATALOG_VERSION)

    @property
    def code(self) -> int:
        """The event's code; 0 for NVML notices, which have none (``codes`` is empty)."""
        return self.codes[0] if self.codes else 0


_UNKNOWN_NAMES = frozenset({"", "<unknown>", "unknown", "n/a"})


def _clean_name(name: str | None) -> str | None:
    if name is None:
        return None
    stripped = name.strip().strip("'\"")
    return None if stripped.lower() in _UNKNOWN_NAMES else stripped


# A pod name's generated tail: a Deployment's ``-<replicaset hash>-<5 chars>``, a Job's or a bare
# ReplicaSet's ``-<5 chars>``. Pods recreated by one controller are one workload.
_POD_TAIL = re.compile(r"(-[a-z0-9]{6,10})?-[a-z0-9]{5}$")


def workload_key(namespace: str | None, pod: str | None) -> str | None:
    """``namespace/controller`` of a pod: the unit a hardware suspicion counts (``None`` if unknown).

    A container restarted in place keeps its pod; a pod recreated by its Deployment or Job gets a new
    generated suffix; both stay one workload. StatefulSet ordinals (``-0``) are kept: distinct replicas.
    """
    if not pod:
        return None
    return f"{namespace or ''}/{_POD_TAIL.sub('', pod) or pod}"


def workload(allocations: Any) -> str | None:
    """The workload of an event's first allocation (see :func:`workload_key`)."""
    for a in allocations or ():
        try:
            return workload_key(a.get("namespace"), a.get("pod"))
        except AttributeError:
            return None
    return None


_XID_KINDS = frozenset({"xid", "sxid", "fallen_off_bus", "gpu_lost", "unknown"})


def fault_event(ev: dict[str, Any], kind: str, ts: int) -> tuple[str, FaultEvent]:
    """The classifier's view of an event, and its kind; what the schema does not allow is ``unknown``."""
    if kind not in _XID_KINDS:
        kind = "unknown"
    code = ev.get("xid")
    if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
        kind, code = "unknown", None  # not what the schema allows: safe default
    try:
        fe = FaultEvent(
            kind=kind,
            ts_ms=ts,
            code=code,
            pid=ev.get("pid"),
            process_name=ev.get("process_name"),
            message=ev.get("message") or "",
            workload=workload(ev.get("allocations")),
            driver_version=ev.get("driver_version") or None,
        )
    except ValueError:  # e.g. kind xid without a code: classify it as an unknown event
        fe = FaultEvent(kind="unknown", ts_ms=ts, code=code, message=ev.get("message") or "")
    return kind, fe
