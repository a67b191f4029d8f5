"""Attach Kubernetes attribution to GpuSample dicts (pure: no gRPC, no file I/O).

``allocations`` (who holds the device) from the kubelet's ``AllocationMap``;
``processes[].namespace/pod/container`` (who uses it) from an injected ``pid -> ProcPod`` resolver.
The matching rules: docs/producer.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupipe_producer.kubelet.mapping import AllocationMap, PodRef, lookup, replica_count
from gpupipe_producer.nvml.records import DeviceIds
from gpupipe_schemas.records import PodAllocation


@dataclass(frozen=True, slots=True)
class ProcPod:
    """What the node can tell about the pod of one process.

    ``in_kubernetes`` False: the process runs outside any pod (its cgroup is not under ``kubepods``).
    ``namespace``/``pod`` are None when the pod UID could not be turned into a name.
    """

    in_kubernetes: bool
    pod_uid: str | None = None
    container_id: str | None = None
    namespace: str | None = None
    pod: str | None = None


PidResolver = Callable[[int], ProcPod | None]

_Holder = tuple[str, str, str]  # namespace, pod, container


def allocation_record(ref: PodRef) -> PodAllocation:
    """The ``PodAllocation`` record of one :class:`PodRef`."""
    rec: PodAllocation = {
        "namespace": ref.namespace,
        "pod": ref.pod,
        "container": ref.container,
        "resource_name": ref.resource_name,
        "replica": ref.replica,
    }
    if ref.claim_name:
        rec["claim_name"] = ref.claim_name
        rec["claim_namespace"] = ref.claim_namespace
        rec["dra_pool"] = ref.dra_pool
        rec["dra_device"] = ref.dra_device
        rec["dra_share_id"] = ref.dra_share_id
    return rec


def gpu_aliases(gpu_index: int | None, pci_bus_id: str | None, minor: int | None = None) -> tuple[str, ...]:
    """Other ids a device plugin may use for a whole GPU: index, ``nvidia<minor>``, PCI bus id forms.

    ``nvidia<N>`` (GKE) names the /dev/nvidia<N> node, i.e. the device *minor* number, which need not
    equal the NVML index; the index stands in only when the minor is unknown.
    """
    out: list[str] = []
    if gpu_index is not None:
        out.append(str(gpu_index))
    if minor is not None:
        out.append(f"nvidia{minor}")
    elif gpu_index is not None:
        out.append(f"nvidia{gpu_index}")
    if pci_bus_id:
        out.append(pci_bus_id)
        short = pci_bus_id.lower()
        if len(short) == 16 and short.startswith("0000"):  # NVML's 00000000:3b:00.0 -> 0000:3b:00.0
            out.append(short[4:])
        elif short != pci_bus_id:
            out.append(short)
    return tuple(out)


def slice_aliases(ids: DeviceIds | None, mig_uuid: str | None) -> tuple[str, ...]:
    """Other ids of a MIG slice: ``<gpu>:<mig>`` (``deviceIDStrategy=index``) and GKE's
    ``nvidia<minor>/gi<GPU instance id>``."""
    if ids is None or not mig_uuid:
        return ()
    forms = ids.mig_aliases.get(mig_uuid)
    if forms is not None:
        return forms
    one = ids.mig.get(mig_uuid)
    return (one,) if one else ()


def device_holders(
    amap: AllocationMap,
    uuid: str | None,
    mig_uuid: str | None = None,
    *,
    aliases: Iterable[str] = (),
) -> tuple[PodRef, ...]:
    """Pods holding a whole GPU or one MIG slice (its MIG UUID, or its ``<gpu>:<mig>`` alias)."""
    if not amap:
        return ()
    if mig_uuid:
        return lookup(amap, uuid or "", mig_uuid, aliases=aliases)
    return lookup(amap, uuid or "", None, aliases=aliases)


def live_holders(
    refs: tuple[PodRef, ...], procs: Iterable[Mapping[str, Any]], resolve: PidResolver | None
) -> tuple[PodRef, ...]:
    """Drop finished pods that still "hold" an exclusively allocated device.

    Kubelets before 1.34 (``KubeletPodResourcesListUseActivePods``) also list pods in a terminal
    phase, with their devices, until the pod is deleted; PodResources carries no phase. An exclusive
    device (no replica ids) has at most one live holder pod, so when several pods hold it and the
    processes on the device belong to some of them, only those are kept. With no process to tell
    (an idle GPU), all are kept: better a doubtful attribution than a wrong one.
    """
    if len(refs) < 2 or resolve is None or any(r.replica is not None for r in refs):
        return refs
    if len({(r.namespace, r.pod) for r in refs}) < 2:
        return refs
    running: set[tuple[str, str]] = set()
    for p in procs:
        try:
            info = resolve(int(p["pid"]))
        except Exception:
            info = None
        if info is not None and info.namespace and info.pod:
            running.add((info.namespace, info.pod))
    kept = tuple(r for r in refs if (r.namespace, r.pod) in running)
    return kept or refs


def _holders(refs: Iterable[PodRef]) -> list[_Holder]:
    seen: dict[_Holder, None] = {}
    for r in refs:
        seen[(r.namespace, r.pod, r.container)] = None
    return list(seen)


def attribute_process(
    proc: Mapping[str, Any], holders: list[_Holder], resolve: PidResolver | None
) -> dict[str, Any]:
    """A copy of one ``GpuProcess`` dict with namespace/pod/container set by the rules above."""
    out = dict(proc)
    info: ProcPod | None = None
    if resolve is not None:
        try:
            info = resolve(int(proc["pid"]))
        except Exception:  # a resolver must never break the sample
            info = None
    if info is not None and not info.in_kubernetes:
        return out
    if info is not None and info.namespace and info.pod:
        containers = {c for ns, pod, c in holders if ns == info.namespace and pod == info.pod}
        out["namespace"], out["pod"] = info.namespace, info.pod
        out["container"] = next(iter(containers)) if len(containers) == 1 else None
        return out
    if len(holders) == 1:
        out["namespace"], out["pod"], out["container"] = holders[0]
    return out


def enrich_sample(
    sample: dict[str, Any],
    amap: AllocationMap,
    resolve: PidResolver | None = None,
    ids: DeviceIds | None = None,
) -> dict[str, Any]:
    """Fill ``allocations`` and the processes' pod fields of one GpuSample dict (in place; returned).

    A lost GPU's record keeps its allocations (who was hit), and has no processes.
    """
    mig = sample.get("mig")
    if mig:
        aliases = slice_aliases(ids, mig.get("mig_uuid"))
        refs = device_holders(amap, sample.get("uuid"), mig.get("mig_uuid"), aliases=aliases)
        keys = (mig.get("mig_uuid") or "", *aliases)
    else:
        minor = ids.minors.get(sample.get("uuid") or "") if ids is not None else None
        aliases = gpu_aliases(sample.get("gpu_index"), sample.get("pci_bus_id"), minor)
        refs = device_holders(amap, sample.get("uuid"), aliases=aliases)
        keys = (sample.get("uuid") or "", *aliases)
    if amap:
        sample["shared_replicas"] = replica_count(amap, keys)
    refs = live_holders(refs, sample.get("processes") or (), resolve)
    sample["allocations"] = [allocation_record(r) for r in refs]
    procs = sample.get("processes")
    if procs:
        holders = _holders(refs)
        sample["processes"] = [attribute_process(p, holders, resolve) for p in procs]
    return sample
