"""Which nodes and devices the alerts service keeps state for: a bound on what its input can make it hold.

Every collaborator of the engine keeps something per GPU or per node (histories, recovery evidence,
health baselines, the latest sample), and any GPU node's producer may write records naming any host
and any UUID. Without a bound, a flood of forged names grows the service until the kernel kills it,
and every restart replays the flood. So a record is taken only for a node and device already known,
or while both counts are under their caps. A record refused here is counted (``capped_node`` or
``capped_device`` in ``gpupipe_alerts_input``), logged at most once a minute, and not dead-lettered:
it is not malformed, and it stays in its topic. Known devices are never evicted: a cap reached turns
an out-of-memory crash into a visible condition (the shipped rule ``GpupipeAlertsCapReached``) while
every device already known keeps its alerts. Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpupipe_consumers.alerts.health_signals import device_key

__all__ = ["DeviceAdmission", "device_of"]


def device_of(rec: Mapping[str, Any]) -> str | None:
    """The device a GpuSample or XidEvent speaks for, as the engine keys its alerts (the canonical PCI
    bus id, else the UUID); None when the record names neither."""
    bus, uuid = rec.get("pci_bus_id"), rec.get("uuid")
    key = device_key(bus if isinstance(bus, str) else None, uuid if isinstance(uuid, str) else None)
    return key or None


class DeviceAdmission:
    """Known nodes and their devices, each count capped; see the module doc."""

    def __init__(self, *, max_nodes: int = 20_000, max_devices: int = 200_000) -> None:
        if max_nodes < 1 or max_devices < 1:
            raise ValueError("max_nodes and max_devices must be at least 1")
        self.max_nodes, self.max_devices = max_nodes, max_devices
        self._nodes: dict[str, set[str]] = {}
        self._devices = 0
        self.refused = {"capped_node": 0, "capped_device": 0}

    def admit(self, host: Any, device: str | None) -> str | None:
        """None when the record may be processed (remembering its node and device); else the reason
        (``capped_node`` or ``capped_device``, counted). A record without a host or device is let
        through: the engine rejects or handles it as it does any such record."""
        if not isinstance(host, str) or not host:
            return None
        known = self._nodes.get(host)
        if known is None:
            if len(self._nodes) >= self.max_nodes:
                return self._refuse("capped_node")
            known = self._nodes[host] = set()
        if device is None or device in known:
            return None
        if self._devices >= self.max_devices:
            if not known:
                del self._nodes[host]  # a node admitted just now with nothing it may keep
            return self._refuse("capped_device")
        known.add(device)
        self._devices += 1
        return None

    def _refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason

    def nodes(self) -> int:
        return len(self._nodes)

    def devices(self) -> int:
        return self._devices

    def full(self) -> bool:
        """Either cap is reached: records of new nodes or devices are being refused."""
        return len(self._nodes) >= self.max_nodes or self._devices >= self.max_devices
