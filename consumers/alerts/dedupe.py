"""The alert engine: classification, deduplication, node rollups and lifecycle (pure; time is passed in).

Inputs are decoded ``XidEvent`` dicts (:meth:`AlertEngine.on_xid`) and health-signal changes from samples
(:meth:`~consumers.alerts.engine_signals.SignalMixin.on_signal`); :meth:`AlertEngine.tick` runs the
timers; :meth:`AlertEngine.take` hands out the alert revisions to publish. Every method takes ``now_ms``
(wall clock, injected): nothing here reads a clock, so tests drive hours of alert life in microseconds.

Keys. One open alert per key ``(scope, hostname, device, signal)``: ``device`` is the canonical PCI bus id
(kernel-log ``0000:3b:00`` and NVML ``00000000:3B:00.0`` are one GPU; a MIG slice's fault is its GPU's),
``signal`` is ``xid:<code>`` (``fallen_off_bus`` / ``gpu_lost`` count as 79), ``sxid:<code>`` (scope
``nvswitch``), a health signal (``ecc_dbe``, ``thermal``...; NVML's recovery-action *event* shares the
``recovery_action`` one), ``gpu_unavailable`` (NVML's GPU-unavailable event; see
:mod:`consumers.alerts.engine_notices`) or ``node_burst`` (scope ``node``, device ``""``).

Lifecycle. Folding and recurrence compare the events' own times (``timestamp_ms``; more than
``max_future_skew_ms`` ahead of ``now_ms`` is taken as ``now_ms``); quiet periods are measured in
processing (wall) time, from when the latest occurrence was *processed* (``seen_at_ms``), so an event
processed late (consumer lag, an outage, a node clock behind) is never born resolved:

* **Dedupe**: an occurrence within ``dedupe_window_ms`` (D) of the open alert's latest occurrence folds into
  it: ``occurrences += 1``, ``last_seen_ms`` moves. Late (out-of-order) occurrences fold in too and may move
  ``first_seen_ms`` back. An occurrence more than D after the latest one is a *recurrence*: the open alert
  is resolved (``resolve_reason="superseded"``) and a new alert (new id) starts; the classifier sees the
  history and may escalate (e.g. Xid 79 or 119/120 coming back after a reset).
* **Duplicates** are not occurrences: an ``event_id`` seen before (producer retry, replay after a
  rebalance or restart; the last ``event_id_memory`` ids are remembered), and the second sighting of one
  Xid by the producer's two sources (``nvml`` and ``kmsg`` records of the same key within
  ``sighting_merge_ms``, which the producer failed to merge). A double sighting still contributes what
  it knows (the kernel line's message and pid may change the classification; NVML's UUID).
* **Resolve by quiet**: an alert with no occurrence processed for ``resolve_after_ms`` (R) resolves
  (``quiet``) -- unless it is *sticky*: a GPU fault whose action needs a reset, reboot or RMA
  (:func:`sticky`: drain alerts and actions RESET_GPU, RESTART_BM, RESTART_VM, DRAIN_AND_RESET). Such a
  GPU does not repeat its Xid while it sits broken, so silence is no evidence; it stays firing until
  evidence of recovery that mends its action class (one table, :mod:`consumers.alerts.recovery_policy`:
  a reset ends reset-class alerts, a reboot also reboot-class ones, only an ack or a replaced GPU
  support/RMA-class ones): the GPU's own (a ``gpu_reset`` signal from the samples, NVML's recovery
  action back to none, a new UUID in the slot: reason ``recovered``), the kernel log's (an event of the
  node under a new boot id: it rebooted; the driver's load line, XidEvent kind ``driver_loaded``),
  which ends a GPU's alert once a sample shows that GPU healthy after it (``Alert.pending`` until then;
  see :mod:`consumers.alerts.engine_evidence`), or an operator's acknowledgement
  (:meth:`AlertEngine.acknowledge`, ``gpupipe alerts --ack ALERT_ID``: reason ``acknowledged``), as
  NVSentinel and GPUd do. Evidence is remembered with its time: a fault processed after evidence that
  followed it is treated as if it had come first (:mod:`consumers.alerts.evidence_memory`).
  Application-class alerts still expire by quiet time.
  Level health signals also resolve when the sample says the condition cleared (``cleared``); the
  samples alone raise and end them, except a ``recovery_action`` alert NVML's event spoke for, which is
  sticky (:func:`~consumers.alerts.alert_policy.sample_owned`). When R < D a resolved alert is
  remembered until D after its last occurrence, and an occurrence in that span *reopens* it (same id,
  status firing again) instead of raising a new one.
* **Node burst**: when occurrences on at least ``node_burst_gpus`` distinct GPUs of one node fall within
  ``node_burst_window_ms``, a node-level alert (``GpuNodeXidStorm``) opens; the GPU alerts keep existing as
  detail and name it in ``parent_alert_id``. Only faults above info that are not job-kill codes (Xid
  43/45) count: killing a multi-GPU job is no node fault. While it is open, every such occurrence on that
  node folds into it (its GPUs, codes, worst severity/action and drain flag accumulate); it resolves after
  ``min(R, D)`` quiet, so it never outlives the span in which it absorbs faults (its per-GPU detail of a
  sticky fault stays firing on its own).
* **Classification** (:func:`~consumers.alerts.classify.classify`, per GPU history and health snapshot) runs
  for every occurrence; an alert keeps the *worst* decision seen (severity, then drain, then action rank):
  it may escalate, never de-escalate, while open.

Emission (:meth:`take`): a new alert, a status change (resolved, reopened) and an escalation are *urgent*
and published at the next :meth:`take`; other changes (count, last seen, pods, parent) at most once per
``update_interval_ms`` per alert (the latest state; the resolved record always carries the final counts).
Each published revision increments ``sequence``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from consumers.alerts.alert_policy import (
    FOLLOWER_CODES,
    STICKY_ACTIONS,
    merge_codes,
    sticky,
    unless_elsewhere,
    workload,
    worse,
)
from consumers.alerts.alert_record import Alert, alert_id, signal_code
from consumers.alerts.classify import (
    Classification,
    FaultEvent,
    GpuHealth,
    GpuXidHistory,
    classify,
)
from consumers.alerts.engine_config import EngineConfig, Key
from consumers.alerts.engine_evidence import EvidenceMixin
from consumers.alerts.engine_notices import NoticeMixin
from consumers.alerts.engine_signals import SignalMixin
from consumers.alerts.evidence_memory import Evidence, EvidenceMemory
from consumers.alerts.health_signals import (
    LEVEL_SIGNALS,
    GpuIdentity,
    InvalidRecord,
    device_key,
)
from consumers.alerts.node_burst import NodeBurstMixin
from consumers.alerts.rules_notice import NOTICE_KINDS

__all__ = ["STICKY_ACTIONS", "AlertEngine", "EngineConfig", "sticky", "worse"]

_EVENT_KINDS = frozenset({"xid", "sxid", "fallen_off_bus", "gpu_lost", "unknown"})
_SINGLE_SOURCES = frozenset({"nvml", "kmsg"})


HealthFn = Callable[[str, str], GpuHealth | None]
IdentityFn = Callable[[str, str], GpuIdentity | None]


class _Sighting:
    __slots__ = ("paired", "source", "ts")

    def __init__(self, ts: int, source: str, paired: bool) -> None:
        self.ts = ts
        self.source = source
        self.paired = paired


class AlertEngine(NodeBurstMixin, EvidenceMixin, NoticeMixin, SignalMixin):
    """See module doc. Not thread-safe: the service serialises calls."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        health: HealthFn | None = None,
        identity: IdentityFn | None = None,
    ) -> None:
        self.cfg = config or EngineConfig()
        self._health = health or (lambda host, dev: None)
        self._identity = identity or (lambda host, dev: None)
        self._open: dict[Key, Alert] = {}
        self._closed: dict[Key, Alert] = {}
        self._changed: dict[str, Alert] = {}
        self._ids: dict[str, Alert] = {}  # open alerts by id
        self._by_gpu: dict[tuple[str, str], set[Key]] = {}  # open alert keys per (host, device)
        self._histories: dict[tuple[str, str], GpuXidHistory] = {}
        self._seen: dict[str, None] = {}
        self._sightings: dict[Key, _Sighting] = {}
        self._signatures: dict[str, set[tuple[Any, ...]]] = {}
        self._bursts: dict[str, dict[str, dict[str, int]]] = {}  # host -> device -> alert id -> ts
        self._node_worst: dict[str, tuple[int, int, int]] = {}
        self._node_signals: dict[str, set[str]] = {}
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "events",
                "duplicate_event_id",
                "double_sighting",
                "new",
                "folded",
                "superseded",
                "reopened",
                "resolved",
                "clock_future",
                "invalid",
                "signals",
                "recovered",
                "acknowledged",
                "reboots_seen",
                "driver_loads",
            ),
            0,
        )
        self._memory = EvidenceMemory()  # boots, driver loads, GPU evidence, healthy samples
        self._evidence_out: list[Evidence] = []  # evidence to publish (take_evidence)

    # ------------------------------------------------------------------------------------ queries

    def open_alerts(self) -> list[Alert]:
        return list(self._open.values())

    def get(self, key: Key) -> Alert | None:
        return self._open.get(key)

    def open_count(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self._open.values():
            out[a.scope] = out.get(a.scope, 0) + 1
        return out

    # ------------------------------------------------------------------------------------- inputs

    def on_xid(self, ev: dict[str, Any], now_ms: int) -> Alert | None:
        """Fold one ``XidEvent`` into the alerts; returns the GPU/NVSwitch alert it landed in (``None`` for
        a duplicate). Raises :class:`InvalidRecord` for an event without host or time."""
        self.counts["events"] += 1
        eid = ev.get("event_id") or None
        if eid is not None:
            if eid in self._seen:
                self.counts["duplicate_event_id"] += 1
                return None
            self._remember(eid)
        host = ev.get("hostname") or ""
        raw_ts = ev.get("timestamp_ms")
        if not host or not isinstance(raw_ts, int) or isinstance(raw_ts, bool):
            self.counts["invalid"] += 1
            raise InvalidRecord("XidEvent without hostname or integer timestamp_ms")
        ts = self._clamp(raw_ts, now_ms)
        kind = ev.get("kind") or "unknown"
        boot = ev.get("boot_id") or None
        if isinstance(boot, str):
            self.seen_boot(host, boot, ts, now_ms)  # before folding: an old boot's fault is over
        else:
            boot = None
        if kind == "driver_loaded":
            what = ev.get("message") or f"driver {ev.get('driver_version') or '?'}"
            self.driver_loaded(host, ts, now_ms, f"kernel log: {what}")
            return None
        if kind in NOTICE_KINDS:  # NVML's recovery-action / GPU-unavailable events: no XID code
            return self._on_notice(ev, kind, host, ts, now_ms, boot)
        if kind not in _EVENT_KINDS:
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
        device = device_key(ev.get("pci_bus_id"), ev.get("uuid"))
        scope, signal = ("nvswitch", "sxid") if kind == "sxid" else ("gpu", "xid")
        eff = fe.effective_code
        key: Key = (scope, host, device, f"{signal}:{signal_code(eff) if scope == 'gpu' else eff}")
        if scope == "gpu" and eff in FOLLOWER_CODES:
            key = self._follows(key, host, device, eff, ts)

        double = False
        source = ev.get("source") or "unknown"
        if source in _SINGLE_SOURCES and self.cfg.sighting_merge_ms:
            prev = self._sightings.get(key)
            double = (
                prev is not None
                and not prev.paired
                and prev.source != source
                and prev.source in _SINGLE_SOURCES
                and abs(ts - prev.ts) <= self.cfg.sighting_merge_ms
            )
            self._sightings[key] = _Sighting(ts, source, double)
        if double:
            self.counts["double_sighting"] += 1

        history = self._history(host, device)
        result, signature = self._classify(fe, history, host, device, key)
        history.record(fe)

        before = self._open.get(key)
        a = self._touch(key, ts, now_ms, 0 if double else 1, anchor=eid or str(ts), first_event_id=eid)
        if a.alertname == "":
            a.alertname = "NvswitchSxidError" if scope == "nvswitch" else "GpuXidError"
        a.last_event_id = eid or a.last_event_id
        if a.boot_id is None and boot is not None:
            a.boot_id = boot
        self._apply(a, result, signature)
        self._identify(a, ev, host, device)
        if not a.message and fe.message:
            a.message = fe.message
            self._dirty(a)
        if a.add_allocations(ev.get("allocations")):
            self._dirty(a)
        if a is not before and self.evaluate(a, now_ms):
            return a  # over already: evidence after it was processed first (an old boot's fault...)
        if scope == "gpu" and not double:
            self._node_burst(a, ts, now_ms)
        return a

    # ------------------------------------------------------------------------------------- timers

    def tick(self, now_ms: int) -> None:
        """Resolve alerts quiet for ``resolve_after_ms``; forget expired tombstones and sightings."""
        r = self.cfg.resolve_after_ms
        d = self.cfg.dedupe_window_ms
        for key, a in list(self._open.items()):
            quiet = min(r, d) if a.scope == "node" else r
            if now_ms - a.seen_at_ms >= quiet and not sticky(a):
                self._resolve(a, now_ms, "quiet")
                self._close(key, a, keep=r < d and key[3] not in LEVEL_SIGNALS)
            elif a.pending is not None:
                self.pending_tick(a, now_ms)
        for key, a in list(self._closed.items()):
            if now_ms - a.seen_at_ms > d:
                del self._closed[key]
        if len(self._sightings) > 4096:
            horizon = now_ms - self.cfg.max_future_skew_ms - self.cfg.sighting_merge_ms
            for key, s in list(self._sightings.items()):
                if s.ts < horizon:
                    del self._sightings[key]
        for host, recent in list(self._bursts.items()):
            # Against the newest time seen on the node, not the clock: a backlog replays old times.
            newest = max(t for alerts in recent.values() for t in alerts.values())
            horizon = min(now_ms, newest) - self.cfg.node_burst_window_ms - self.cfg.max_future_skew_ms
            for device, alerts in list(recent.items()):
                for aid, t in list(alerts.items()):
                    if t < horizon:
                        del alerts[aid]
                if not alerts:
                    del recent[device]
            if not recent:
                del self._bursts[host]

    def take(self, now_ms: int, *, force: bool = False) -> list[Alert]:
        """Revisions due for publishing (snapshots, in the order they changed); see module doc.

        ``force`` hands out every pending change regardless of the update interval (at shutdown, so
        that the published state, which a restart restores, is complete)."""
        out: list[Alert] = []
        interval = self.cfg.update_interval_ms
        for aid, a in list(self._changed.items()):
            if not (force or a.urgent or a.last_emit_ms is None or now_ms - a.last_emit_ms >= interval):
                continue
            a.sequence += 1
            a.dirty = a.urgent = False
            a.last_emit_ms = now_ms
            out.append(a.snapshot())
            del self._changed[aid]
        return out

    def pending(self) -> int:
        return len(self._changed)

    def _follows(self, key: Key, host: str, device: str, code: int, ts: int) -> Key:
        """Xid 45 (channels torn down after another error) and 154 (the recovery action a fault needs)
        are details of the fault they follow: the open alert of another XID on the same GPU within the
        classifier's solo window (154: the memory fault's alert) -- one fault, one alert (review D10)."""
        window = self.cfg.classify.solo_window_ms
        best: Alert | None = None
        mem: Key = ("gpu", host, device, "xid:48")
        candidates = [mem] if code == 154 else list(self._by_gpu.get((host, device), ()))
        for k in candidates:
            a = self._open.get(k)
            if a is None or not k[3].startswith("xid:") or a.codes[:1] == (code,):
                continue
            if abs(ts - a.last_seen_ms) <= window and (best is None or a.last_seen_ms > best.last_seen_ms):
                best = a
        return best.key if best is not None else key

    def _history(self, host: str, device: str) -> GpuXidHistory:
        history = self._histories.get((host, device))
        if history is None:
            history = self._histories[(host, device)] = GpuXidHistory(
                horizon_ms=max(self.cfg.classify.recurrence_window_ms, self.cfg.dedupe_window_ms)
            )
            for t in self._memory.resets(host, device):  # evidence processed before this GPU's faults
                history.record_reset(t)
        return history

    # ---------------------------------------------------------------------------------- internals

    def _remember(self, eid: str) -> None:
        seen = self._seen
        seen[eid] = None
        if len(seen) > self.cfg.event_id_memory:
            del seen[next(iter(seen))]

    def _clamp(self, ts: int, now_ms: int) -> int:
        if ts > now_ms + self.cfg.max_future_skew_ms:
            self.counts["clock_future"] += 1
            return now_ms
        return ts

    def _dirty(self, a: Alert) -> None:
        if not a.dirty:
            a.dirty = True
        self._changed[a.alert_id] = a

    def _classify(
        self, fe: FaultEvent, history: GpuXidHistory, host: str, device: str, key: Key
    ) -> tuple[Classification | None, tuple[Any, ...]]:
        """Classify, or ``None`` when this exact fault was already classified within the open alert.

        A repeat with the same code, process and message inside one incident cannot change the decision
        (the rules look at distinct processes, messages and incidents separated by more than the
        classifier's incident gap or by a reset), so the storm path skips the work -- unless the GPU was
        reset or its node rebooted since the alert's latest occurrence (the fault back after it may
        escalate, e.g. Xid 79 minutes after a reboot).
        """
        a = self._open.get(key)
        sig = (fe.kind, fe.code, fe.pid, fe.process_name, fe.message)
        resets = history.resets()
        if (
            a is not None
            and fe.ts_ms - a.last_seen_ms < self.cfg.classify.incident_gap_ms
            and not (resets and resets[-1] > a.last_seen_ms)  # a reset since: a new incident
        ):
            seen = self._signatures.get(a.alert_id)
            if seen is not None and sig in seen:
                return None, sig
        result = classify(fe, history, self._health(host, device), self.cfg.classify)
        if result.rule == "app_fault.repeat_distinct_workloads":
            window = self.cfg.classify.app_fault_window_ms
            result = unless_elsewhere(result, history, self._histories, (host, device), fe.ts_ms, window)
        return result, sig

    def _apply(self, a: Alert, c: Classification | None, sig: tuple[Any, ...]) -> None:
        if c is None:
            return
        seen = self._signatures.setdefault(a.alert_id, set())
        if len(seen) < 64:
            seen.add(sig)
        new_decision = (c.severity.value, c.drain_node, c.action.value)
        current = (a.severity, a.drain_node, a.action)
        if a.name and c.codes[:1] in ((171,), (172,)) and not worse(current, new_decision):
            # 171/172 qualify the 48 (DRAM or SRAM): same decision, a more precise workflow branch
            a.codes = merge_codes(a.codes, c.codes)
            a.rule, a.description, a.runbook = c.rule, c.reason, c.runbook
            self._dirty(a)
            return
        if a.name and not worse(new_decision, current):
            merged = merge_codes(a.codes, c.codes)  # a folded detail (172, 95, 45, 154) is listed
            if merged != a.codes:
                a.codes = merged
                self._dirty(a)
            a.known = a.known and c.known
            return
        first = not a.name
        a.codes = merge_codes(a.codes, c.codes) if a.codes else tuple(c.codes)
        a.name = c.name
        a.severity = c.severity.value
        a.cause_class = c.cause_class.value
        a.action = c.action.value
        a.nvidia_action = c.nvidia_action.value if c.nvidia_action is not None else None
        a.drain_node = c.drain_node
        a.known = c.known if first else a.known and c.known
        a.rule = c.rule
        a.description = c.reason
        a.runbook = c.runbook
        a.catalog_version = c.catalog_version
        a.urgent = True
        self._dirty(a)

    def _identify(self, a: Alert, ev: dict[str, Any], host: str, device: str) -> None:
        ident = self._identity(host, device) if (ev.get("uuid") is None or a.gpu_index is None) else None
        uuid = ev.get("uuid") or (ident.uuid if ident else None)
        changed = False
        if a.gpu_uuid is None and uuid and a.scope == "gpu":
            a.gpu_uuid = uuid
            changed = True
        if a.gpu_index is None:
            idx = ev.get("gpu_index")
            if idx is None and ident is not None:
                idx = ident.gpu_index
            if idx is not None:
                a.gpu_index = idx
                changed = True
        if a.model_name is None:
            a.model_name = ev.get("model_name") or (ident.model_name if ident else None)
        if a.driver_version is None:
            a.driver_version = ev.get("driver_version") or (ident.driver_version if ident else None)
        if a.mig_uuid is None and a.occurrences <= 1:
            a.mig_uuid = ev.get("mig_uuid")
        if not a.gpus or (a.gpu_uuid and a.gpus == [device]):
            a.gpus = [a.gpu_uuid or device]
            changed = True
        if not ev.get("allocations") and ident is not None and a.add_allocations(ident.allocations):
            changed = True
        if changed:
            self._dirty(a)

    def _touch(
        self,
        key: Key,
        ts: int,
        now_ms: int,
        count: int,
        *,
        anchor: str,
        first_event_id: str | None = None,
    ) -> Alert:
        """The open alert an occurrence at ``ts`` belongs to (supersede / reopen / new), folded."""
        d = self.cfg.dedupe_window_ms
        a = self._open.get(key)
        if a is not None and ts > a.last_seen_ms + d:
            self._resolve(a, now_ms, "superseded")
            self.counts["superseded"] += 1
            self._close(key, a, keep=False)
            a = None
        if a is None:
            t = self._closed.get(key)
            if t is not None and t.first_seen_ms - d <= ts <= t.last_seen_ms + d:
                del self._closed[key]
                t.status = "firing"
                t.resolved_at_ms = None
                t.resolve_reason = None
                t.urgent = True
                self._open[key] = a = t
                self._ids[t.alert_id] = t
                self._by_gpu.setdefault((key[1], key[2]), set()).add(key)
                self.counts["reopened"] += 1
        if a is None:
            scope, host, device, _ = key
            self._closed.pop(key, None)
            a = Alert(
                alert_id=alert_id(scope, host, device, key[3], anchor),
                key=key,
                scope=scope,
                alertname="",
                signal=key[3].split(":", 1)[0],
                hostname=host,
                first_seen_ms=ts,
                last_seen_ms=ts,
                device=device,
                first_event_id=first_event_id,
                urgent=True,
            )
            self._open[key] = a
            self._ids[a.alert_id] = a
            self._by_gpu.setdefault((host, device), set()).add(key)
            self.counts["new"] += 1
        else:
            self.counts["folded"] += 1
            if a.pending is not None and ts > a.pending.since_ms:
                a.pending = None  # the fault is back after the reboot / driver load: not over
                a.urgent = True
        if ts < a.first_seen_ms:
            a.first_seen_ms = ts
        if ts > a.last_seen_ms:
            a.last_seen_ms = ts
        a.seen_at_ms = now_ms
        a.occurrences += count
        self._dirty(a)
        return a

    def _resolve(self, a: Alert, now_ms: int, reason: str) -> None:
        a.status = "resolved"
        a.resolved_at_ms = now_ms
        a.resolve_reason = reason
        a.urgent = True
        self.counts["resolved"] += 1
        self._dirty(a)
        self._signatures.pop(a.alert_id, None)

    def _close(self, key: Key, a: Alert, *, keep: bool) -> None:
        self._open.pop(key, None)
        self._ids.pop(a.alert_id, None)
        keys = self._by_gpu.get((key[1], key[2]))
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_gpu[(key[1], key[2])]
        if keep:
            self._closed[key] = a
        if a.scope == "node":
            self._node_worst.pop(a.alert_id, None)
            self._node_signals.pop(a.alert_id, None)
