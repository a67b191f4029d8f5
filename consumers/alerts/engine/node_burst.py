"""Node-level rollup: several GPUs of one node failing at once (``GpuNodeXidStorm``).

When occurrences on at least ``node_burst_gpus`` distinct GPUs of one node fall within
``node_burst_window_ms``, a node alert opens in the table; the GPU alerts stay as detail and name it in
``parent_alert_id``. It stays open while any of its sticky members fires (and absorbs the node's faults
meanwhile): Alertmanager inhibits the members under it, so resolving it first would send a RESOLVED and
page every member again for one incident. See :mod:`gpupipe_consumers.alerts.engine.facade`, "Node burst".
"""

from __future__ import annotations

from collections.abc import Collection

from gpupipe_consumers.alerts.engine.alert_policy import counts_toward_burst, merge_codes, rank
from gpupipe_consumers.alerts.engine.alert_record import Alert, AlertName
from gpupipe_consumers.alerts.engine.alert_table import AlertTable, Key
from gpupipe_consumers.alerts.rules.catalog import CATALOG_VERSION

__all__ = ["NodeBursts"]


class NodeBursts:
    """Recent GPU occurrences per node, and each open node alert's worst member and code-less signals."""

    def __init__(self, table: AlertTable) -> None:
        self._table = table
        self._cfg = table.cfg
        self._bursts: dict[str, dict[str, dict[str, int]]] = {}  # host -> device -> alert id -> ts
        self._node_worst: dict[str, tuple[int, int, int]] = {}  # node alert id -> worst member's rank
        self._node_signals: dict[str, set[str]] = {}  # node alert id -> signals of members without a code
        table.when_ended(self._forget)

    def _forget(self, a: Alert) -> None:
        if a.scope == "node":
            self._node_worst.pop(a.alert_id, None)
            self._node_signals.pop(a.alert_id, None)

    def forget(self, hosts: Collection[str], gpus: Collection[tuple[str, str]]) -> None:
        """Drop the recent occurrences of ``hosts`` and of the devices ``gpus`` (evicted by admission)."""
        for host in hosts:
            self._bursts.pop(host, None)
        for host, device in gpus:
            recent = self._bursts.get(host)
            if recent is not None:
                recent.pop(device, None)
                if not recent:
                    del self._bursts[host]

    def restored(self, a: Alert) -> None:
        """A restored open node alert: its members' worst decision is the one it shows."""
        if a.scope == "node":
            self._node_worst[a.alert_id] = rank(a.severity, a.drain_node, a.action)

    def expire(self, now_ms: int) -> None:
        """Forget occurrences older than the burst window, measured against the newest time seen on the
        node, not the clock: a backlog replays old times."""
        for host, recent in list(self._bursts.items()):
            newest = max(t for alerts in recent.values() for t in alerts.values())
            horizon = min(now_ms, newest) - self._cfg.node_burst_window_ms - self._cfg.max_future_skew_ms
            for device, alerts in list(recent.items()):
                for aid, t in list(alerts.items()):
                    if t < horizon:
                        del alerts[aid]
                if not alerts:
                    del recent[device]
            if not recent:
                del self._bursts[host]

    def count(self, gpu_alert: Alert, ts: int, now_ms: int) -> None:
        """Count a GPU occurrence toward its node's burst (see module doc).

        Only faults that carry a health signal count
        (:func:`~gpupipe_consumers.alerts.engine.alert_policy.counts_toward_burst`): killing an 8-GPU job
        logs Xid 45 on
        every GPU, which says nothing about the node. Per node, the newest occurrence time of each GPU's
        alerts is kept (bounded by GPUs x codes), so the cost of an event does not grow with the node's
        history (a flood on one node costs what a flood spread over many does).
        """
        if not counts_toward_burst(gpu_alert):
            return
        cfg = self._cfg
        table = self._table
        host = gpu_alert.hostname
        recent = self._bursts.get(host)
        if recent is None:
            recent = self._bursts[host] = {}
        per_device = recent.setdefault(gpu_alert.device, {})
        if ts > per_device.get(gpu_alert.alert_id, -1):
            per_device[gpu_alert.alert_id] = ts
        key: Key = ("node", host, "", "node_burst")
        node = table.get(key)
        if node is not None and ts <= node.last_seen_ms + cfg.dedupe_window_ms:
            table.touch(key, ts, now_ms, 1, anchor="")
            members = [(ts, gpu_alert.device, gpu_alert.alert_id)]
        elif node is not None and table.held(node):
            # Open past its span only because sticky members still fire: it goes on absorbing the node's
            # faults, so every GPU alert it inhibits in Alertmanager is one it lists.
            table.fold(node, ts, now_ms, 1)
            members = [(ts, gpu_alert.device, gpu_alert.alert_id)]
        else:
            # Events arrive out of event-time order (two topics, late records): compare each event with
            # the window on both sides of its own time, so a late record is never grouped with faults an
            # hour after it.
            w = cfg.node_burst_window_ms
            in_window = [
                (t, device, aid)
                for device, alerts in recent.items()
                for aid, t in alerts.items()
                if abs(t - ts) <= w
            ]
            devices = {m[1] for m in in_window}
            if len(devices) < cfg.node_burst_gpus:
                return
            first = min(m[0] for m in in_window)
            node = table.touch(key, first, now_ms, len(in_window), anchor=str(first))
            if ts > node.last_seen_ms:
                node.last_seen_ms = ts
            members = in_window
        if node.alertname == "":
            node.alertname = AlertName.NODE_BURST
            node.name = "NODE_XID_BURST"
            node.rule = "node_burst"
            node.catalog_version = CATALOG_VERSION
        changed = False
        for _, device, member_id in members:
            member = self._member(member_id)
            if member is None:
                continue
            changed |= node.add_gpu(member.gpu_uuid or device)
            if member.parent_alert_id != node.alert_id:
                member.parent_alert_id = node.alert_id
                table.dirty(member)
            if not member.codes:  # NVML's GPU-unavailable event: a fault without an XID code
                signals = self._node_signals.setdefault(node.alert_id, set())
                changed |= member.signal not in signals
                signals.add(member.signal)
            codes = merge_codes(node.codes, member.codes[:1]) if node.codes else member.codes[:1]
            if codes != node.codes:
                node.codes = tuple(sorted(codes))
                changed = True
            member_rank = rank(member.severity, member.drain_node, member.action)
            if member_rank > self._node_worst.get(node.alert_id, (-1, -1, -1)):
                self._node_worst[node.alert_id] = member_rank
                node.severity = member.severity
                node.drain_node = node.drain_node or member.drain_node
                node.action = member.action
                node.cause_class = member.cause_class
                node.known = member.known
                node.runbook = (
                    "Several GPUs of this node reported errors at once: look at what they share (one "
                    "multi-GPU job for application XIDs; the PCIe switch, power, cooling or driver for "
                    "hardware ones). "
                    "Per-GPU detail: the alerts naming this one as parent_alert_id. Worst GPU: "
                    + member.runbook
                )
                node.urgent = True
                changed = True
            node.drain_node = node.drain_node or member.drain_node
        what = [f"XIDs {', '.join(map(str, node.codes))}"] if node.codes else []
        what += sorted(self._node_signals.get(node.alert_id, ()))
        node.description = (
            f"{len(node.gpus)} GPUs of {host} reported faults ({'; '.join(what)}) within "
            f"{cfg.node_burst_window_ms // 1000}s of each other (threshold {cfg.node_burst_gpus} GPUs); "
            f"worst: {node.severity} {node.action}."
        )
        if changed:
            table.dirty(node)

    def _member(self, member_id: str) -> Alert | None:
        a = self._table.by_id(member_id)
        return a if a is not None and a.status == "firing" else None
