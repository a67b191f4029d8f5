"""Build XidEvent records from what the node agent saw (pure: no clock, no I/O).

In: the merger's sightings, kernel-log ``FallenOffBus``/``DriverLoaded`` reports, NVML notices, the
source's bus id -> GPU map and the kubelet map. Out: XidEvent dicts. Field by field: docs/producer.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpupipe.domain import pci
from gpupipe_producer.kubelet.mapping import AllocationMap, PodRef
from gpupipe_producer.nvml.records import VENDOR, DeviceIds, GpuRef
from gpupipe_producer.samples.enrich import allocation_record, device_holders, gpu_aliases, slice_aliases
from gpupipe_producer.xid.kmsg_parse import DriverLoaded, FallenOffBus, KernelXid
from gpupipe_schemas.records import PodAllocation, XidEvent, XidKind, XidSource

__all__ = [
    "SOURCE_NAMES",
    "XidContext",
    "build_xid_event",
    "driver_loaded_event",
    "event_id",
    "fallen_off_bus_event",
    "kmsg_fields",
    "nvml_fields",
]

SOURCE_NAMES: dict[str, XidSource] = {"nvml": "nvml", "kmsg": "kmsg", "nvml+kmsg": "nvml_kmsg"}

MigLookup = Callable[[str, int | None, int | None], str | None]


def event_id(hostname: str, source: str, bus_id: str, code: str, timestamp_ms: int) -> str:
    return f"{hostname}|{source}|{bus_id}|{code}|{timestamp_ms}"


class XidContext:
    """What attribution needs from the rest of the agent, captured at emit time."""

    __slots__ = ("amap", "bus_map", "hostname", "ids", "mig_lookup", "slices")

    def __init__(
        self,
        hostname: str,
        bus_map: Mapping[str, GpuRef],
        amap: AllocationMap,
        *,
        slices: Mapping[str, Iterable[str]] | None = None,
        mig_lookup: MigLookup | None = None,
        ids: DeviceIds | None = None,
    ) -> None:
        self.hostname = hostname
        self.bus_map = bus_map  # gpupipe.domain.pci.device_key of the bus id -> GPU
        self.amap = amap
        self.slices = slices or {}  # GPU uuid -> MIG uuids of its slices
        self.mig_lookup = mig_lookup
        self.ids = ids  # minors and MIG slice aliases (device plugins not advertising UUIDs)

    def gpu_for_bus(self, bus_id: str | None) -> GpuRef | None:
        if not bus_id:
            return None
        key = pci.device_key(bus_id)
        return None if key is None else self.bus_map.get(key)

    def allocations(self, uuid: str | None, mig_uuid: str | None, gpu: GpuRef | None) -> list[PodAllocation]:
        if not uuid or not self.amap:
            return []
        if mig_uuid:
            refs: Iterable[PodRef] = device_holders(
                self.amap, uuid, mig_uuid, aliases=slice_aliases(self.ids, mig_uuid)
            )
        else:
            found = set(
                device_holders(
                    self.amap,
                    uuid,
                    aliases=gpu_aliases(gpu.gpu_index, gpu.pci_bus_id, gpu.minor) if gpu is not None else (),
                )
            )
            for m in self.slices.get(uuid, ()):
                found.update(device_holders(self.amap, uuid, m, aliases=slice_aliases(self.ids, m)))
            refs = sorted(found, key=PodRef.sort_key)
        return [allocation_record(r) for r in refs]


def kmsg_fields(ev: KernelXid, seen_ms: int) -> dict[str, Any]:
    """The merger ``fields`` of a kernel-log Xid/SXid received at wall time ``seen_ms``."""
    return {
        "kind": ev.kind,
        "reported_bus_id": ev.pci_bus_id,
        "pid": ev.pid,
        "process_name": ev.process_name,
        "message": ev.message,
        "gpu_instance_id": ev.gpu_instance_id,
        "compute_instance_id": ev.compute_instance_id,
        "kmsg_ts_ms": seen_ms,
    }


def nvml_fields(ev: Mapping[str, Any]) -> dict[str, Any]:
    """The merger ``fields`` of one dict from :class:`gpupipe_producer.nvml.events.XidEventWatcher`."""
    return {
        "kind": "xid",
        "nvml_bus_id": ev.get("pci_bus_id") or None,
        "uuid": ev.get("uuid"),
        "gpu_index": ev.get("gpu_index"),
        "gpu_instance_id": ev.get("gpu_instance_id"),
        "compute_instance_id": ev.get("compute_instance_id"),
        "mig_uuid": ev.get("mig_uuid"),
        "nvml_ts_ms": int(ev["timestamp_ms"]),
        "nvml_seq": ev.get("nvml_seq"),
    }


def build_xid_event(merged: Mapping[str, Any], ctx: XidContext) -> XidEvent:
    """The XidEvent record of one merger output (``source`` nvml, kmsg or nvml+kmsg)."""
    source: XidSource = SOURCE_NAMES.get(str(merged.get("source")), "unknown")
    kind: XidKind = "sxid" if merged.get("kind") == "sxid" else "xid"
    xid = int(merged["xid"])
    reported = merged.get("nvml_bus_id") or merged.get("reported_bus_id") or merged.get("pci_bus_id") or ""
    gpu = None if kind == "sxid" else ctx.gpu_for_bus(reported)
    uuid = merged.get("uuid") or (gpu.uuid if gpu is not None else None) or None
    gi, ci = merged.get("gpu_instance_id"), merged.get("compute_instance_id")
    mig_uuid = merged.get("mig_uuid")
    if mig_uuid is None and uuid and gi is not None and ctx.mig_lookup is not None:
        try:
            mig_uuid = ctx.mig_lookup(uuid, gi, ci)
        except Exception:
            mig_uuid = None
    stamps = [t for t in (merged.get("nvml_ts_ms"), merged.get("kmsg_ts_ms")) if t is not None]
    ts = int(min(stamps)) if stamps else 0
    bus = gpu.pci_bus_id if gpu is not None and gpu.pci_bus_id else reported
    gpu_index = merged.get("gpu_index")
    if gpu_index is None and gpu is not None:
        gpu_index = gpu.gpu_index
    pid = merged.get("pid")
    eid = event_id(ctx.hostname, source, bus, f"{kind}{xid}", ts)
    if merged.get("kmsg_seq") is not None:
        # Two reports of the same code on the same GPU within one millisecond are two events: the
        # kernel's record number tells them apart (and is stable when a backlog is read again).
        eid += f"|s{int(merged['kmsg_seq'])}"
    elif merged.get("nvml_seq") is not None:
        # NVML alone (no kernel-log record to pair with): the agent's own number of the NVML event.
        # NVML events are delivered once and the id is fixed when the record is spooled, so replays
        # keep it; a restart starts over, with later timestamps.
        eid += f"|n{int(merged['nvml_seq'])}"
    return {
        "event_id": eid,
        "timestamp_ms": ts,
        "hostname": ctx.hostname,
        "kind": kind,
        "xid": xid,
        "pci_bus_id": bus,
        "gpu_index": gpu_index,
        "uuid": uuid,
        "model_name": (gpu.model_name or None) if gpu is not None else None,
        "driver_version": gpu.driver_version if gpu is not None else None,
        "pid": int(pid) if pid is not None else None,
        "process_name": merged.get("process_name"),
        "message": merged.get("message") or "",
        "gpu_instance_id": gi,
        "compute_instance_id": ci,
        "mig_uuid": mig_uuid,
        "source": source,
        "vendor": VENDOR,
        "allocations": ctx.allocations(uuid, mig_uuid, gpu),
    }


#: nvmlGpuRecoveryAction_t (nvml.h, nvidia-ml-py 13.615).
RECOVERY_ACTIONS = {
    0: "NONE",
    1: "GPU_RESET",
    2: "NODE_REBOOT",
    3: "DRAIN_P2P",
    4: "DRAIN_AND_RESET",
    5: "RECOVER_IMEX_DOMAIN",
    6: "BUS_RESET",
    7: "SYSTEM_REBOOT",
}


def nvml_notice_event(notice: Mapping[str, Any], ctx: XidContext) -> XidEvent:
    """The XidEvent of an NVML recovery-action or GPU-unavailable event (no XID number)."""
    kind: XidKind = "recovery_action" if notice.get("type") == "recovery_action" else "gpu_unavailable"
    bus = str(notice.get("pci_bus_id") or "")
    gpu = ctx.gpu_for_bus(bus)
    uuid = notice.get("uuid") or (gpu.uuid if gpu is not None else None) or None
    data = int(notice.get("data") or 0)
    if kind == "recovery_action":
        message = f"GPU recovery action: {RECOVERY_ACTIONS.get(data, 'UNKNOWN')} ({data})"
    else:
        message = f"GPU unavailable (event data {data})"
    ts = int(notice["timestamp_ms"])
    return {
        "event_id": event_id(ctx.hostname, "nvml", bus, f"{kind}{data}", ts)
        + (f"|n{int(notice['nvml_seq'])}" if notice.get("nvml_seq") is not None else ""),
        "timestamp_ms": ts,
        "hostname": ctx.hostname,
        "kind": kind,
        "xid": None,
        "pci_bus_id": bus,
        "gpu_index": notice.get("gpu_index"),
        "uuid": uuid,
        "model_name": (gpu.model_name or None) if gpu is not None else None,
        "driver_version": gpu.driver_version if gpu is not None else None,
        "pid": None,
        "process_name": None,
        "message": message,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "nvml",
        "vendor": VENDOR,
        "allocations": ctx.allocations(uuid, None, gpu),
    }


def fallen_off_bus_event(ev: FallenOffBus, seen_ms: int, ctx: XidContext) -> XidEvent:
    """The XidEvent (kind ``fallen_off_bus``, source ``kmsg``) of a kernel "fallen off the bus" report."""
    gpu = ctx.gpu_for_bus(ev.pci_bus_id)
    bus = gpu.pci_bus_id if gpu is not None and gpu.pci_bus_id else ev.pci_bus_id
    uuid = gpu.uuid if gpu is not None and gpu.uuid else None
    return {
        "event_id": event_id(ctx.hostname, "kmsg", bus, "fallen_off_bus", seen_ms),
        "timestamp_ms": seen_ms,
        "hostname": ctx.hostname,
        "kind": "fallen_off_bus",
        "xid": None,
        "pci_bus_id": bus,
        "gpu_index": gpu.gpu_index if gpu is not None else None,
        "uuid": uuid,
        "model_name": (gpu.model_name or None) if gpu is not None else None,
        "driver_version": gpu.driver_version if gpu is not None else None,
        "pid": None,
        "process_name": None,
        "message": " ".join(part.strip() for part in ev.raw.splitlines())[:4096],
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "kmsg",
        "vendor": VENDOR,
        "allocations": ctx.allocations(uuid, None, gpu),
    }


def driver_loaded_event(
    ev: DriverLoaded, seen_ms: int, ctx: XidContext, kmsg_seq: int | None = None
) -> XidEvent:
    """The XidEvent (kind ``driver_loaded``, source ``kmsg``) of the driver's load line: no GPU, no code."""
    eid = event_id(ctx.hostname, "kmsg", "", "driver_loaded", seen_ms)
    if kmsg_seq is not None:
        eid += f"|s{int(kmsg_seq)}"
    return {
        "event_id": eid,
        "timestamp_ms": seen_ms,
        "hostname": ctx.hostname,
        "kind": "driver_loaded",
        "xid": None,
        "pci_bus_id": "",
        "gpu_index": None,
        "uuid": None,
        "model_name": None,
        "driver_version": ev.driver_version,
        "pid": None,
        "process_name": None,
        "message": ev.text,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "kmsg",
        "vendor": VENDOR,
        "allocations": [],
    }
