"""The XidEvent path: one decoded ``XidEvent`` into the alerts (:meth:`XidIntake.on_xid`).

In order: duplicates and replays are dropped (:mod:`gpupipe_consumers.alerts.engine.input_guard`); a boot id
and the driver's load line are evidence (:mod:`gpupipe_consumers.alerts.engine.recovery_evidence`); NVML's
notice kinds are keyed by :mod:`gpupipe_consumers.alerts.engine.nvml_notices` and folded like a fault; a fault
is keyed (Xid 45 and 154 join the fault they follow), merged with its other source's sighting, classified
(:mod:`gpupipe_consumers.alerts.engine.fault_decisions`), folded into
its alert in the table, matched against evidence processed before it, and counted toward its node's
burst (:mod:`gpupipe_consumers.alerts.engine.node_burst`). A fault whose own time is older than
``max_event_age_ms`` when processed only feeds the GPU's history (``stale_event``): it is a kernel-log
backlog read again, not a new fault. See :mod:`gpupipe_consumers.alerts.engine.facade` for the rules.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from gpupipe_consumers.alerts.engine.alert_policy import FOLLOWER_CODES, MEMORY_FOLLOWER_CODES
from gpupipe_consumers.alerts.engine.alert_record import Alert, AlertName, alert_device_key, signal_code
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.engine.fault_decisions import FaultDecisions
from gpupipe_consumers.alerts.engine.gpu_histories import GpuHistories
from gpupipe_consumers.alerts.engine.input_guard import InputGuard
from gpupipe_consumers.alerts.engine.node_burst import NodeBursts
from gpupipe_consumers.alerts.engine.nvml_notices import NOTICE_ALERTNAMES, NvmlNotices
from gpupipe_consumers.alerts.engine.recovery_evidence import RecoveryEvidence
from gpupipe_consumers.alerts.rules.classify import FaultEvent
from gpupipe_consumers.alerts.rules.classify_model import fault_event, workload_key
from gpupipe_consumers.alerts.rules.notice import NOTICE_KINDS
from gpupipe_consumers.alerts.rules.operational import refine as refine_operational

__all__ = ["XidIntake"]

_SINGLE_SOURCES = frozenset({"nvml", "kmsg"})


class _Sighting:
    __slots__ = ("paired", "source", "ts")

    def __init__(self, ts: int, source: str, paired: bool) -> None:
        self.ts = ts
        self.source = source
        self.paired = paired


class _Occurrence(NamedTuple):
    """Where and when one XidEvent happened, as the fold needs it."""

    eid: str | None
    boot: str | None
    ts: int
    now_ms: int
    position: tuple[int, int] | None


def _note(a: Alert, alertname: str, occ: _Occurrence) -> None:
    """What the occurrence tells the alert about itself: its name, latest event, input position, boot."""
    if a.alertname == "":
        a.alertname = alertname
    a.last_event_id = occ.eid or a.last_event_id
    if occ.position is not None:
        a.last_input = occ.position
    if a.boot_id is None and occ.boot is not None:
        a.boot_id = occ.boot


class XidIntake:
    """Folds XidEvents into the table; owns the latest single-source sighting per key (the producer's
    ``nvml`` and ``kmsg`` records of one Xid that it failed to merge)."""

    def __init__(
        self,
        table: AlertTable,
        *,
        guard: InputGuard,
        decisions: FaultDecisions,
        histories: GpuHistories,
        recovery: RecoveryEvidence,
        bursts: NodeBursts,
        notices: NvmlNotices,
    ) -> None:
        self._table = table
        self._cfg = table.cfg
        self._counts = table.counts
        self._guard = guard
        self._decisions = decisions
        self._histories = histories
        self._recovery = recovery
        self._bursts = bursts
        self._notices = notices
        self._sightings: dict[Key, _Sighting] = {}

    def on_xid(
        self, ev: dict[str, Any], now_ms: int, position: tuple[int, int] | None = None
    ) -> Alert | None:
        """Fold one ``XidEvent``; returns the GPU/NVSwitch alert it landed in (``None`` for a duplicate or
        evidence). Raises :class:`~gpupipe_consumers.alerts.engine.health_signals.InvalidRecord` for an event
        without host or time. ``position``:
        (partition, offset) of the event in the XidEvent topic (see
        :mod:`gpupipe_consumers.alerts.engine.input_guard`)."""
        self._counts["events"] += 1
        admitted = self._guard.admit(ev, now_ms)
        if admitted is None:
            return None
        eid, host, ts = admitted
        kind = ev.get("kind") or "unknown"
        boot = ev.get("boot_id") or None
        if isinstance(boot, str):
            self._recovery.seen_boot(host, boot, ts, now_ms)  # before folding: an old boot's fault is over
        else:
            boot = None
        if kind == "driver_loaded":
            what = ev.get("message") or f"driver {ev.get('driver_version') or '?'}"
            self._recovery.driver_loaded(host, ts, now_ms, f"kernel log: {what}")
            return None
        device = alert_device_key(ev.get("pci_bus_id"), ev.get("uuid"))
        notice = kind in NOTICE_KINDS  # NVML's recovery-action / GPU-unavailable events: no XID code
        if notice:
            found = self._notices.occurrence(ev, kind, host, device, ts, now_ms)
            if found is None:
                return None
            key, fe = found
        else:
            kind, fe = fault_event(ev, kind, ts)
            scope = "nvswitch" if kind == "sxid" else "gpu"
            key = self._key(scope, host, device, fe.effective_code, ts)
        if self._guard.replayed(key, position):  # counted before a restart
            return None
        if not notice and now_ms - ts > self._cfg.max_event_age_ms:
            # A backlog re-read without its cursor (a first start, a lost cursor) brings back every XID of
            # the boot with its original time: a GPU reset and used since must not be drained for it.
            self._counts["stale_event"] += 1
            self._histories.get(host, device).record(fe)
            return None
        return self._fold(ev, fe, key, _Occurrence(eid, boot, ts, now_ms, position), notice=notice)

    def _key(self, scope: str, host: str, device: str, eff: int, ts: int) -> Key:
        """The alert key of a fault; a follower code joins the open alert of the fault it follows."""
        if scope == "nvswitch":
            return (scope, host, device, f"sxid:{eff}")
        key: Key = (scope, host, device, f"xid:{signal_code(eff)}")
        if eff in FOLLOWER_CODES:
            key = self._follows(key, host, device, eff, ts)
        return key

    def _fold(self, ev: dict[str, Any], fe: FaultEvent, key: Key, occ: _Occurrence, *, notice: bool) -> Alert:
        """Classify the fault and fold it into its alert; then evidence, identity and the node's burst.

        A ``notice`` (NVML's, no XID code) has no second source to merge with, no history entry and no
        operational category; an open recovery-action alert takes it whatever its gap (the GPU's need
        changed or was restated: the same incident as long as it lasts)."""
        scope, host, device, _signal = key
        double = not notice and self._double_sighting(key, ev.get("source") or "unknown", occ.ts)
        if double:
            self._counts["double_sighting"] += 1
        result, signature = self._decisions.classify(fe, host, device, key)
        if not notice:
            result = refine_operational(ev.get("operational"), result)  # an unknown code: by its category
            self._histories.get(host, device).record(fe)
        before = self._table.get(key)
        if notice and before is not None and fe.kind == "recovery_action":
            a = before
            self._table.fold(a, occ.ts, occ.now_ms, 1)
        else:
            a = self._table.touch(
                key,
                occ.ts,
                occ.now_ms,
                0 if double else 1,
                anchor=occ.eid or str(occ.ts),
                first_event_id=occ.eid,
                continues=None
                if notice
                else lambda open_alert: self._continues(open_alert, fe.workload, occ.boot),
            )
        if notice:
            name = NOTICE_ALERTNAMES[fe.kind]
        else:
            name = AlertName.SXID if scope == "nvswitch" else AlertName.XID
        _note(a, name, occ)
        self._decisions.apply(a, result, signature)
        self._decisions.identify(a, ev, host, device)
        if a.learn(fe.message, ev.get("allocations")):
            self._table.dirty(a)
        if a is not before and self._recovery.evaluate(a, occ.now_ms):
            return a  # over already: evidence after it was processed first (an old boot's fault...)
        if scope == "gpu" and not double:  # counts_toward_burst decides (gpu_unavailable does)
            self._bursts.count(a, occ.ts, occ.now_ms)
        return a

    def _continues(self, a: Alert, job: str | None, boot: str | None) -> bool:
        """Whether a recurrence after the dedupe window is still open alert ``a``'s incident: the same
        job (:func:`_same_job`) and no recovery attempt since its latest occurrence. A fault back after a
        reset, a reboot or a driver load is a new incident (the classifier escalates it: Xid 79 after a
        reboot is a hardware case), so it supersedes as before. Without a recovery attempt, a sticky
        alert's GPU is still broken: whatever job reports an XID of its key then, it is the same fault
        (a contained Xid 94 after a DBE whose remapping failed must not replace the drain alert with a
        warning that resolves when quiet)."""
        if a.pending is not None or (boot is not None and a.boot_id not in (None, boot)):
            return False
        if any(r > a.last_seen_ms for r in self._histories.get(a.hostname, a.device).resets()):
            return False
        return a.sticky or _same_job(a, job)

    def _double_sighting(self, key: Key, source: str, ts: int) -> bool:
        """The second sighting of one Xid by the producer's other source within ``sighting_merge_ms``: no
        occurrence, though what it knows still goes into the alert (the kernel line's message and pid,
        NVML's UUID)."""
        merge_ms = self._cfg.sighting_merge_ms
        if source not in _SINGLE_SOURCES or not merge_ms:
            return False
        prev = self._sightings.get(key)
        double = (
            prev is not None
            and not prev.paired
            and prev.source != source
            and prev.source in _SINGLE_SOURCES
            and abs(ts - prev.ts) <= merge_ms
        )
        self._sightings[key] = _Sighting(ts, source, double)
        return double

    def _follows(self, key: Key, host: str, device: str, code: int, ts: int) -> Key:
        """Xid 45 (channels torn down after another error), 154 (the recovery action a fault needs) and
        63/64 (the page retirement of a memory fault) are details of the fault they follow: the open
        alert of another XID on the same GPU within the classifier's solo window (154, 63, 64: the
        memory fault's alert, keyed as 48) -- one fault, one alert, one page."""
        window = self._cfg.classify.solo_window_ms
        best: Alert | None = None
        table = self._table
        mem: Key = ("gpu", host, device, "xid:48")
        candidates = [table.get(mem)] if code in MEMORY_FOLLOWER_CODES else table.gpu_alerts(host, device)
        for a in candidates:
            if a is None or not a.key[3].startswith("xid:") or a.codes[:1] == (code,):
                continue
            if abs(ts - a.last_seen_ms) <= window and (best is None or a.last_seen_ms > best.last_seen_ms):
                best = a
        return best.key if best is not None else key

    def forget(self, hosts: Collection[str]) -> None:
        """Drop the sightings of ``hosts`` (evicted by admission)."""
        if hosts:  # a device's sightings alone expire within the merge window
            for key in [k for k in self._sightings if k[1] in hosts]:
                del self._sightings[key]

    def expire(self, now_ms: int) -> None:
        """Forget old sightings once there are many (a sighting matters only within the merge window)."""
        if len(self._sightings) > 4096:
            horizon = now_ms - self._cfg.max_future_skew_ms - self._cfg.sighting_merge_ms
            for key, s in list(self._sightings.items()):
                if s.ts < horizon:
                    del self._sightings[key]


def _same_job(a: Alert, job: str | None) -> bool:
    """Whether an occurrence of ``job`` (``namespace/controller``, ``None`` if unknown) continues open
    alert ``a``: the same job hit the same fault again, or one side names no job (attribution comes and
    goes: a fault while no pod held the GPU, a pod listed late). Another job's fault is another incident:
    its owners are told on their own, and the classifier counts it as a second workload."""
    if job is None:
        return True
    mine = {workload_key(ns, pod) for ns, pod, _container in a.allocations}
    mine.discard(None)
    return not mine or job in mine
