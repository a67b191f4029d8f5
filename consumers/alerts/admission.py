"""Which nodes and devices the alerts service keeps state for: a bound on memory that no flood turns into
blindness.

Contract: :meth:`DeviceAdmission.admit` never refuses a record. It remembers the record's node and device
(most recently seen last) and, when that takes a count past its cap, picks what the service must forget
(:meth:`DeviceAdmission.take_evicted`); the service drops their state in the engine and the health
tracker. Pure: no I/O, no clocks.

Rules and reasons in full: docs/alerts.md, "Module notes", ``admission.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import alert_device_key

__all__ = ["OVER_CAP", "DeviceAdmission", "Evicted", "device_of"]

#: How far past ``max_nodes``/``max_devices``/``max_devices_per_node`` state grows while everything
#: known holds an open alert, before alerting nodes or devices are forgotten.
OVER_CAP = 2
#: Nodes forgotten at once (a fraction of the cap): each forget scans the engine's per-GPU maps once.
BATCH_DIVISOR = 64


def device_of(rec: Mapping[str, Any]) -> str | None:
    """The device a GpuSample or XidEvent speaks for, as the engine keys its alerts (the canonical PCI
    bus id, else the UUID); None when the record names neither."""
    bus, uuid = rec.get("pci_bus_id"), rec.get("uuid")
    key = alert_device_key(bus if isinstance(bus, str) else None, uuid if isinstance(uuid, str) else None)
    return key or None


@dataclass(frozen=True, slots=True)
class Evicted:
    """State to forget: a whole node (``device`` None) or one device of it; ``alerting``: it held open
    alerts."""

    host: str
    device: str | None
    alerting: bool


class _Node:
    __slots__ = ("devices", "verified")

    def __init__(self) -> None:
        self.devices: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self.verified = False


def _never(*_args: str) -> bool:
    return False


class DeviceAdmission:
    """Known nodes and their devices, least recently seen first; see the module doc.

    ``node_busy(host)`` / ``device_busy(host, device)``: whether the engine holds an open alert there
    (the service wires them to the alert table)."""

    def __init__(
        self,
        *,
        max_nodes: int = 20_000,
        max_devices: int = 200_000,
        max_devices_per_node: int = 64,
        node_busy: Callable[[str], bool] = _never,
        device_busy: Callable[[str, str], bool] = _never,
    ) -> None:
        if max_nodes < 1 or max_devices < 1 or max_devices_per_node < 1:
            raise ValueError("max_nodes, max_devices and max_devices_per_node must be at least 1")
        self.max_nodes, self.max_devices = max_nodes, max_devices
        self.max_devices_per_node = max_devices_per_node
        self.node_busy, self.device_busy = node_busy, device_busy
        self._nodes: OrderedDict[str, _Node] = OrderedDict()
        self._devices = 0
        self._batch = max(1, max_nodes // BATCH_DIVISOR)
        self._idle_scan_after = 0  # admissions to go before scanning for idle nodes again
        # (keep, calls to go) before scanning for alerting nodes again for that keep
        self._alert_scan_skip: tuple[str | None, int] = (None, 0)
        self._evicted: list[Evicted] = []
        self.counts = dict.fromkeys(
            ("evicted_idle_node", "evicted_alerting_node", "evicted_idle_device", "evicted_alerting_device"),
            0,
        )
        self.counts["over_cap"] = 0

    # --------------------------------------------------------------------------------------- input

    def admit(self, host: Any, device: str | None, *, verified: bool = False) -> None:
        """Remember ``host`` and ``device`` as seen now (``verified``: the record passed node identity).
        A record without a host is ignored: the engine rejects or handles it as it does any such record."""
        if not isinstance(host, str) or not host:
            return
        node = self._nodes.get(host)
        if node is None:
            if len(self._nodes) >= self.max_nodes:
                self._make_room(host)
            node = self._nodes[host] = _Node()
        else:
            self._nodes.move_to_end(host)
        if verified:
            node.verified = True
        if device is None:
            return
        if device in node.devices:
            node.devices.move_to_end(device)
            return
        if len(node.devices) >= self.max_devices_per_node:
            self._room_on(host, node)
        if self._devices >= self.max_devices:
            self._make_room(host)
        node.devices[device] = None
        self._devices += 1

    def take_evicted(self) -> list[Evicted]:
        """What was evicted since the last call: the service forgets it."""
        out, self._evicted = self._evicted, []
        return out

    # ------------------------------------------------------------------------------------- eviction

    def _make_room(self, keep: str) -> None:
        """At a cap (nodes or devices): forget idle nodes; else grow up to OVER_CAP; else alerting ones."""
        under = len(self._nodes) < OVER_CAP * self.max_nodes and self._devices < OVER_CAP * self.max_devices
        if under and self._idle_scan_after > 0:  # a scan found no idle node a moment ago
            self._idle_scan_after -= 1
            self.counts["over_cap"] += 1
            return
        if self._evict_nodes(keep, busy=False):
            return
        if under:  # every node holds an alert: no scan again for a batch of admissions
            self._idle_scan_after = self._batch
            self.counts["over_cap"] += 1
            return
        self._evict_nodes(keep, busy=True)

    def evict_alerting(self, keep: str | None) -> int:
        """The engine holds as many open alerts as it may: forget a batch of the least recently seen nodes
        that hold some (never ``keep``), so that a new fault still opens one. Returns how many went.
        After a scan that found none (``keep`` holds them all), the next batch of calls for the same
        ``keep`` do not scan."""
        skip_for, left = self._alert_scan_skip
        if skip_for == keep and left > 0:
            self._alert_scan_skip = (keep, left - 1)
            return 0
        n = self._evict_nodes(keep, busy=True)
        self._alert_scan_skip = (keep, 0 if n else self._batch)
        return n

    def _evict_nodes(self, keep: str | None, *, busy: bool) -> int:
        """Forget up to a batch of the least recently seen nodes with (``busy``) or without open alerts,
        unverified ones first. Returns how many went."""
        unverified: list[str] = []
        verified: list[str] = []
        for host, node in self._nodes.items():
            if host == keep or self.node_busy(host) != busy:
                continue
            (verified if node.verified else unverified).append(host)
            if len(unverified) >= self._batch:
                break
        victims = (unverified + verified)[: self._batch]
        for host in victims:
            node = self._nodes.pop(host)
            self._devices -= len(node.devices)
            self._evicted.append(Evicted(host, None, busy))
            self.counts["evicted_alerting_node" if busy else "evicted_idle_node"] += 1
        return len(victims)

    def _room_on(self, host: str, node: _Node) -> None:
        """``host`` holds ``max_devices_per_node`` devices: forget its least recently seen idle one; else
        grow up to OVER_CAP; else its least recently seen one."""
        victim = next((d for d in node.devices if not self.device_busy(host, d)), None)
        busy = False
        if victim is None:
            if len(node.devices) < OVER_CAP * self.max_devices_per_node:
                self.counts["over_cap"] += 1
                return
            victim, busy = next(iter(node.devices)), True
        del node.devices[victim]
        self._devices -= 1
        self._evicted.append(Evicted(host, victim, busy))
        self.counts["evicted_alerting_device" if busy else "evicted_idle_device"] += 1

    # ------------------------------------------------------------------------------------- queries

    def nodes(self) -> int:
        return len(self._nodes)

    def devices(self) -> int:
        return self._devices

    def full(self) -> bool:
        """Either cap is reached: new nodes or devices now cost older state."""
        return len(self._nodes) >= self.max_nodes or self._devices >= self.max_devices
