"""What the alert engine remembers of recovery evidence, and its wire form on ``gpu.alerts.v1`` (pure).

Rules and reasons in full: docs/alerts.md, "Module notes", ``engine/evidence_memory.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import Alert, AlertName, action_record, alert_id, to_record

__all__ = ["EVIDENCE_KINDS", "Evidence", "EvidenceMemory", "evidence_from_record", "evidence_record"]

#: Kinds of published evidence: ``boot`` (a boot id, its earliest time), ``driver_load``, the GPU's own.
EVIDENCE_KINDS = frozenset({"boot", "driver_load", "reset", "gpu_back", "replaced"})


@dataclass(frozen=True, slots=True)
class Evidence:
    """One piece of recovery evidence: ``kind`` (:data:`EVIDENCE_KINDS`) of ``host`` (and ``device`` for a
    GPU's own) at ``at_ms``, the node's time."""

    kind: str
    host: str
    at_ms: int
    detail: str = ""
    device: str = ""
    boot_id: str | None = None
    uuid: str | None = None


class EvidenceMemory:
    """See module doc."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.boots: dict[str, dict[str, int]] = {}  # host -> boot id -> earliest time under it
        self.loads: dict[str, list[tuple[int, str]]] = {}  # host -> (time, detail), sorted
        self.gpu: dict[tuple[str, str], list[Evidence]] = {}  # (host, device) -> evidence, sorted
        self.healthy_at: dict[tuple[str, str], int] = {}  # latest healthy sample
        self.uuids: dict[tuple[str, str], str] = {}  # UUID of the latest healthy sample

    def forget(self, hosts: Collection[str], gpus: Collection[tuple[str, str]]) -> None:
        """Drop what is known of ``hosts`` and of the devices ``gpus`` (evicted by admission)."""
        for host in hosts:
            self.boots.pop(host, None)
            self.loads.pop(host, None)
        for per_gpu in (self.gpu, self.healthy_at, self.uuids):
            for key in [k for k in per_gpu if k[0] in hosts] if hosts else []:
                del per_gpu[key]
            for key in gpus:
                per_gpu.pop(key, None)

    # -------------------------------------------------------------------------------------- boots

    def boot(self, host: str, boot_id: str, ts: int) -> bool:
        """An event of ``host`` at ``ts`` under ``boot_id``; True when that changed what is known (a boot
        id not seen before, or an earlier time for one). One dict lookup in the common case."""
        boots = self.boots.get(host)
        if boots is None:
            self.boots[host] = {boot_id: ts}
            return True
        known = boots.get(boot_id)
        if known is not None and known <= ts:
            return False
        boots[boot_id] = ts
        if len(boots) > self.keep:
            del boots[min(boots, key=boots.__getitem__)]
        return True

    def current_boot(self, host: str) -> str | None:
        boots = self.boots.get(host)
        return max(boots, key=boots.__getitem__) if boots else None

    def earliest(self, host: str, boot_id: str) -> int | None:
        return self.boots.get(host, {}).get(boot_id)

    def successor(self, host: str, boot_id: str, ts: int) -> tuple[str, int] | None:
        """The boot that followed ``boot_id`` on ``host`` after a fault at ``ts``: the earliest-starting
        other boot whose earliest event is after ``ts`` (``None``: no reboot known since)."""
        best: tuple[str, int] | None = None
        for b, t in self.boots.get(host, {}).items():
            if b != boot_id and t > ts and (best is None or t < best[1]):
                best = (b, t)
        return best

    def reboot_times(self, host: str) -> list[int]:
        """Times the host is known to have rebooted: the earliest time of each boot but the first known."""
        times = sorted(self.boots.get(host, {}).values())
        return times[1:]

    # ------------------------------------------------------------------------------ driver loads

    def driver_load(self, host: str, ts: int, detail: str) -> bool:
        loads = self.loads.setdefault(host, [])
        if any(t == ts for t, _ in loads):
            return False
        bisect.insort(loads, (ts, detail))
        del loads[: max(0, len(loads) - self.keep)]
        return True

    def loads_after(self, host: str, ts: int) -> list[tuple[int, str]]:
        """Driver loads at or after ``ts`` (a fault at the load's own time predates the load)."""
        return [x for x in self.loads.get(host, ()) if x[0] >= ts]

    # ------------------------------------------------------------------------------ GPU evidence

    def gpu_evidence(self, ev: Evidence) -> bool:
        items = self.gpu.setdefault((ev.host, ev.device), [])
        if any(x.kind == ev.kind and x.at_ms == ev.at_ms for x in items):
            return False
        bisect.insort(items, ev, key=lambda x: x.at_ms)
        del items[: max(0, len(items) - self.keep)]
        return True

    def gpu_after(self, host: str, device: str, ts: int) -> list[Evidence]:
        """The GPU's own evidence strictly after ``ts`` (a sample at the fault's time may show the fault)."""
        return [x for x in self.gpu.get((host, device), ()) if x.at_ms > ts]

    def resets(self, host: str, device: str) -> list[int]:
        """Every time the GPU is known to have been reset: reboots and driver loads of its node, its own
        evidence (seeds a new recurrence history; see ``GpuXidHistory.record_reset``)."""
        out = self.reboot_times(host) + [t for t, _ in self.loads.get(host, ())]
        return out + [x.at_ms for x in self.gpu.get((host, device), ())]

    # ----------------------------------------------------------------------------------- samples

    def healthy(self, host: str, device: str, ts: int) -> None:
        key = (host, device)
        if ts > self.healthy_at.get(key, -1):
            self.healthy_at[key] = ts

    def healthy_since(self, host: str, device: str, ts: int) -> int | None:
        """Time of the GPU's latest healthy sample if it is at or after ``ts``."""
        seen = self.healthy_at.get((host, device))
        return seen if seen is not None and seen >= ts else None


# ---------------------------------------------------------------------------------------- wire form


def evidence_record(ev: Evidence, emitted_at_ms: int, instance: str = "") -> dict[str, Any]:
    """The GpuAlert ``action`` record publishing ``ev`` (remediation kind ``evidence``, outcome
    ``recorded``): ``signal`` is the kind, ``first_seen_ms`` its time; keyed per host (one partition, in
    order). Readers that want alerts skip ``action`` records; the alerts service restores from them."""
    scope = "gpu" if ev.device else "node"
    a = Alert(
        alert_id=alert_id("node", ev.host, "", "evidence", ""),
        key=(scope, ev.host, ev.device, ev.kind),
        scope=scope,
        alertname=AlertName.RECOVERY_EVIDENCE,
        signal=ev.kind,
        hostname=ev.host,
        first_seen_ms=ev.at_ms,
        last_seen_ms=ev.at_ms,
        severity="info",
        name=ev.kind,
        description=ev.detail,
        action="IGNORE",
        rule=f"evidence.{ev.kind}",
        device=ev.device,
        gpu_uuid=ev.uuid,
        boot_id=ev.boot_id,
    )
    rec = to_record(a, emitted_at_ms, instance)
    return action_record(
        rec,
        outcome="recorded",
        node=ev.host,
        dry_run=False,
        detail=ev.detail,
        at_ms=emitted_at_ms,
        kind="evidence",
    )


def evidence_from_record(rec: dict[str, Any]) -> Evidence | None:
    """The evidence an ``action`` record of kind ``evidence`` publishes (``None`` for other records)."""
    rem = rec.get("remediation") or {}
    if rec.get("status") != "action" or rem.get("kind") != "evidence":
        return None
    kind = rec.get("signal")
    host = rec.get("hostname")
    at = rec.get("first_seen_ms")
    if kind not in EVIDENCE_KINDS or not host or not isinstance(at, int):
        return None
    if kind == "boot" and not rec.get("boot_id"):
        return None
    return Evidence(
        kind=kind,
        host=host,
        at_ms=at,
        detail=rec.get("description") or "",
        device=rec.get("pci_bus_id") or "",
        boot_id=rec.get("boot_id"),
        uuid=rec.get("gpu_uuid"),
    )
