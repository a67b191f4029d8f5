"""Record building for the NVML source (pure): GpuSample templates and XidEvent dicts.

The template is derived from the schema file itself, so every GpuSample field is always present
(a field added to the schema later appears as its default, null) and nothing here restates the
contract's field list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupipe_schemas import catalog
from gpupipe_schemas.records import XidEvent

#: The ``vendor`` of every record this producer writes (it reads GPUs through NVIDIA's NVML).
VENDOR = "nvidia"

# Fields that describe the device rather than measure it: kept on a lost GPU's record.
IDENTITY_FIELDS = frozenset(
    {
        "timestamp_ms",
        "hostname",
        "gpu_index",
        "uuid",
        "pci_bus_id",
        "model_name",
        "driver_version",
        "numa_node",
        "mig",
        "mig_enabled",
        "allocations",
        "interval_ms",
        "gpu_lost",
        # device identity (dcgm-exporter label rows; appended to GpuSample for the metrics consumer)
        "serial",
        "vbios_version",
        "brand",
        "nvml_version",
        "inforom_image_version",
        "allocations_stale",
        # Set by the node agent for chargeback, not measured by NVML.
        "allocations_known",
        "mig_configured_fraction",
        "mig_energy_by_slice",
        "mig_parent_energy_mj",
        "shared_replicas",
        "vendor",
    }
)
_LIST_FIELDS = ("allocations", "processes", "nvlink_link_counters")


def _template() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in catalog.current("GpuSample").raw["fields"]:
        out[f["name"]] = f.get("default")
    return out


_TEMPLATE = _template()
SAMPLE_FIELDS: tuple[str, ...] = tuple(_TEMPLATE)
METRIC_FIELDS: tuple[str, ...] = tuple(
    n for n in SAMPLE_FIELDS if n not in IDENTITY_FIELDS and n not in _LIST_FIELDS
)


def empty_sample() -> dict[str, Any]:
    """A GpuSample dict with every field at its schema default (metrics null, lists empty)."""
    s = dict(_TEMPLATE)
    s["allocations"] = []
    s["processes"] = []
    s["nvlink_link_counters"] = []
    s["gpu_lost"] = False
    return s


@dataclass(frozen=True, slots=True)
class GpuRef:
    """Who a GPU is, for attributing events (kernel-log XIDs carry only a PCI bus id)."""

    gpu_index: int
    uuid: str
    pci_bus_id: str  # NVML form, 00000000:3B:00.0
    model_name: str
    driver_version: str | None
    #: /dev/nvidia<minor> (nvmlDeviceGetMinorNumber); None when NVML does not say.
    minor: int | None = None


@dataclass(frozen=True, slots=True)
class DeviceIds:
    """Ids device plugins use besides UUIDs (see :func:`gpupipe_producer.samples.enrich.gpu_aliases`).

    ``minors``: GPU UUID -> /dev/nvidia<minor> number (GKE's ``nvidia<N>`` is the minor, not the
    NVML index). ``mig``: MIG UUID -> ``<gpu index>:<mig index>`` (``deviceIDStrategy=index``).
    ``mig_aliases``: MIG UUID -> every other id of that slice: the index form and GKE's
    ``nvidia<minor>/gi<GPU instance id>``.
    """

    minors: Mapping[str, int] = field(default_factory=dict)
    mig: Mapping[str, str] = field(default_factory=dict)
    mig_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LostGpu:
    """What the source passes to ``on_gpu_lost`` when NVML answers GPU_IS_LOST for a GPU."""

    gpu: GpuRef
    timestamp_ms: int
    call: str  # the group (and NVML error text) that saw it
    message: str


def _event_id(hostname: str, source: str, bus_id: str, code: str, timestamp_ms: int) -> str:
    return f"{hostname}|{source}|{bus_id}|{code}|{timestamp_ms}"


def gpu_lost_xid_event(lost: LostGpu, hostname: str) -> XidEvent:
    """The XidEvent (kind ``gpu_lost``, source ``nvml``) for a GPU NVML reported lost."""
    g = lost.gpu
    return {
        "event_id": _event_id(hostname, "nvml", g.pci_bus_id, "gpu_lost", lost.timestamp_ms),
        "timestamp_ms": lost.timestamp_ms,
        "hostname": hostname,
        "kind": "gpu_lost",
        "xid": None,
        "pci_bus_id": g.pci_bus_id,
        "gpu_index": g.gpu_index,
        "uuid": g.uuid or None,
        "model_name": g.model_name or None,
        "driver_version": g.driver_version,
        "pid": None,
        "process_name": None,
        "message": lost.message,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "nvml",
        "vendor": VENDOR,
        "allocations": [],
    }


def nvml_xid_event(
    event: dict[str, Any],
    hostname: str,
    *,
    model_name: str | None = None,
    driver_version: str | None = None,
) -> XidEvent:
    """The XidEvent (kind ``xid``, source ``nvml``) for one dict delivered by the event watcher."""
    bus = event.get("pci_bus_id") or ""
    xid = event.get("xid")
    return {
        "event_id": _event_id(hostname, "nvml", bus, f"xid{xid}", int(event["timestamp_ms"])),
        "timestamp_ms": int(event["timestamp_ms"]),
        "hostname": hostname,
        "kind": "xid",
        "xid": xid,
        "pci_bus_id": bus,
        "gpu_index": event.get("gpu_index"),
        "uuid": event.get("uuid"),
        "model_name": model_name,
        "driver_version": driver_version,
        "pid": None,
        "process_name": None,
        "message": "",
        "gpu_instance_id": event.get("gpu_instance_id"),
        "compute_instance_id": event.get("compute_instance_id"),
        "mig_uuid": event.get("mig_uuid"),
        "source": "nvml",
        "vendor": VENDOR,
        "allocations": [],
    }
