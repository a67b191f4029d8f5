"""What record fields mean where several services read them: one reading, said once.

The producer writes a GpuSample; chargeback bills it, recommend judges it idle, metrics and the
reports show it. If each decided for itself which key names a GPU and which field is its
activity, a second reading that differs would bill one thing and recommend another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

UNALLOCATED = "__unallocated__"
MIG_SHARED = "__mig_shared__"
UNATTRIBUTED = "__unattributed__"
"""GPU time that cannot be attributed to a tenant: time while the kubelet could not say who holds
the GPU (``allocations_known`` false). Use by processes no pod owns on a shared GPU is not here:
it is split among the GPU's holders by allocation."""
PSEUDO_NAMESPACES = (UNALLOCATED, MIG_SHARED, UNATTRIBUTED)


def gpu_key(sample: Mapping[str, Any]) -> str:
    """Accounting key of a sample: the MIG device UUID for a slice, else the GPU UUID."""
    mig = sample.get("mig")
    return str(mig["mig_uuid"] if mig else sample["uuid"])


def sample_kafka_key(sample: dict[str, Any]) -> bytes:
    """Kafka key of a sample: its physical GPU's UUID, for a MIG slice too. Every record of a GPU
    then shares a partition, so the consumer instance serving a slice also reads the GPU's
    device-wide readings (temperature, power, clocks, energy) and XIDs that the slice reports as
    its own. Each slice's records stay in order, as they share that partition."""
    return str(sample["uuid"]).encode()


def xid_kafka_key(event: Mapping[str, Any]) -> bytes:
    """Kafka key of an XID event: its physical GPU's UUID as for samples (a slice's XID included),
    else its MIG UUID, PCI bus id, or host for a node-wide event such as a driver load."""
    ident = event.get("uuid") or event.get("mig_uuid") or event.get("pci_bus_id") or event.get("hostname")
    return (ident or "unknown").encode()


def activity_ratio(sample: dict[str, Any]) -> float | None:
    """sm_active_ratio where reported, else gpu_util_ratio, clamped to 0..1; None when neither."""
    if sample.get("gpu_lost"):
        return None
    value = sample.get("sm_active_ratio")
    if value is None:
        value = sample.get("gpu_util_ratio")
    if value is None:
        return None
    return min(max(float(value), 0.0), 1.0)
