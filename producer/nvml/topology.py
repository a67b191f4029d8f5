"""The node's GPU topology through NVML: the ``gpus`` and ``pairs`` of a ``GpuTopology`` record.

==============================================  ==============================================
``nvmlDeviceGetPciInfo`` (via the source)       gpus[].pci_bus_id
kernel PCI view, else memory affinity           gpus[].numa_node (as GpuSample's)
``nvmlDeviceGetNumaNodeId``                     gpus[].memory_numa_node
``nvmlDeviceGetCpuAffinity``                    gpus[].cpu_affinity (cpulist)
per link ``nvmlDeviceGetNvLinkState``,          gpus[].nvlinks[]: link, state, remote_type,
``...RemoteDeviceType``, ``...RemotePciInfo``   remote_pci_bus_id, peer_uuid
per pair ``nvmlDeviceGetTopologyCommonAncestor``  pairs[].pcie_ancestor
per pair ``nvmlDeviceGetP2PStatus`` (NVLINK)    pairs[].nvlink_p2p
==============================================  ==============================================

Every call goes through :meth:`DeviceContext.call`: a call the GPU or driver cannot answer leaves its
field null; link ids are probed from 0 until NVML refuses one (NotSupported: no NVLink;
InvalidArgument: past the last link, as GB200 answers for 18..35); the remote end of an inactive link
is not asked. A GPU lost before or during the read keeps its identity only (``gpu_lost``). Read at
the agent's start and when its GPU set changes, never per tick: about 50 calls per GPU plus 2 per pair.

Checked against NVIDIA's mock libnvidia-ml through the real pynvml (H100, A100, GB200, L40S profiles):
18 (A100: 12) active links per GPU to NVSwitches whose PCI address NVML gives as ``FFFFFFFF:FF:FF.0``
(unresolved), InvalidArgument from link 18; common ancestor SINGLE within a NUMA node and SYSTEM
across; NVLink P2P OK on NVSwitch profiles, NOT_SUPPORTED on L40S; one 64-bit CPU word per NUMA node.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gpupipe.domain.gpu_topology import cpu_list, nvlink_domains
from gpupipe.domain.pci import device_key
from gpupipe_producer.nvml.base import DeviceContext, NvmlErrors
from gpupipe_producer.nvml.identity import SYSFS_PCI_DEVICES, attached_numa_node, text
from gpupipe_producer.nvml.records import GpuRef
from gpupipe_schemas.records import (
    GpuPair,
    NvLink,
    NvLinkRemoteType,
    NvLinkState,
    PcieAncestorLevel,
    TopologyGpu,
)

log = logging.getLogger("gpupipe.nvml")

MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in NVML 13
CPU_SET_WORDS = 16  # 1024 CPUs: NVML fills the words the host has
#: NVML_P2P_CAPS_INDEX_NVLINK (the binding spells NVML_P2P_CAPS_INDEX_READ as a tuple: use numbers).
P2P_CAPS_NVLINK = 2
P2P_STATUS_OK = 0
LEVELS = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}
LINK_STATES = {0: "inactive", 1: "active", 2: "sleep", 3: "active_traffic_disabled"}
REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch"}  # 0xFF: NVML_NVLINK_DEVICE_TYPE_UNKNOWN


@dataclass
class TopologyRead:
    """What one read found, and what NVML refused on the way (for metrics and logs)."""

    gpus: list[TopologyGpu]
    pairs: list[GpuPair]
    errors: Counter[str] = field(default_factory=Counter)
    learned: list[tuple[int, str, str]] = field(default_factory=list)  # (gpu index, call key, reason)


class _Tally:
    """The contexts' reporter for one read."""

    def __init__(self, read: TopologyRead) -> None:
        self._read = read

    def error(self, kind: str) -> None:
        self._read.errors[kind] += 1

    def garbage(self, field: str) -> None:
        self._read.errors["garbage"] += 1

    def learned(self, ctx: DeviceContext, key: str, reason: str) -> None:
        self._read.learned.append((ctx.index, key, reason))


def read_topology(
    nvml: Any, gpus: Sequence[GpuRef], lost: Collection[str] = (), sysfs_pci: str = SYSFS_PCI_DEVICES
) -> TopologyRead:
    """The topology of ``gpus`` (the source's GPUs; UUIDs in ``lost`` are not asked). Never raises
    for NVML trouble; NVML must be initialised."""
    read = TopologyRead([], [])
    tally = _Tally(read)
    errors = NvmlErrors(nvml)
    by_bus = {device_key(g.pci_bus_id): g.uuid for g in gpus if device_key(g.pci_bus_id)}
    usable: list[tuple[TopologyGpu, DeviceContext]] = []
    for ref in sorted(gpus, key=lambda g: g.gpu_index):
        entry = _identity(ref, lost)
        read.gpus.append(entry)
        if entry["gpu_lost"]:
            continue
        try:
            ctx = _context(nvml, ref, tally, errors)
            if ctx is None:
                continue
            _read_gpu(ctx, entry, by_bus, sysfs_pci)
        except errors.lost:
            entry["gpu_lost"] = True  # the source notices on its own poll and reports it
            continue
        usable.append((entry, ctx))
    for i, (a, ctx_a) in enumerate(usable):
        for b, ctx_b in usable[i + 1 :]:
            read.pairs.append(_pair(ctx_a, ctx_b, a["gpu_index"], b["gpu_index"], errors))
    domains = nvlink_domains((g["gpu_index"] for g in read.gpus), cast(list[dict[str, Any]], read.pairs))
    for g in read.gpus:
        g["nvlink_domain"] = domains.get(g["gpu_index"])
    return read


def _identity(ref: GpuRef, lost: Collection[str]) -> TopologyGpu:
    return {
        "gpu_index": ref.gpu_index,
        "uuid": ref.uuid,
        "pci_bus_id": ref.pci_bus_id or None,
        "gpu_lost": ref.uuid in lost,
        "numa_node": None,
        "memory_numa_node": None,
        "cpu_affinity": None,
        "nvlinks": [],
        "nvlink_domain": None,
    }


def _context(nvml: Any, ref: GpuRef, tally: _Tally, errors: NvmlErrors) -> DeviceContext | None:
    """A fresh context for ``ref``'s GPU; None when its handle cannot be had or is another GPU's
    (the enumeration changed under the source: the next GPU-set change reads again). Raises the
    module's GpuIsLost."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(ref.gpu_index)
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
    except errors.lost:
        raise
    except errors.base as exc:
        tally.error(type(exc).__name__)
        return None
    if uuid != ref.uuid:
        log.info("GPU %d is %s now, not %s: topology left for the next read", ref.gpu_index, uuid, ref.uuid)
        return None
    ctx = DeviceContext(nvml, ref.gpu_index, handle, tally, errors=errors)
    ctx.uuid, ctx.pci_bus_id = ref.uuid, ref.pci_bus_id
    return ctx


def _read_gpu(ctx: DeviceContext, out: TopologyGpu, by_bus: dict[str | None, str], sysfs_pci: str) -> None:
    h = ctx.handle
    out["numa_node"] = attached_numa_node(ctx, sysfs_pci)
    node = ctx.call("numa_node_id", "nvmlDeviceGetNumaNodeId", h)
    out["memory_numa_node"] = node if isinstance(node, int) and node >= 0 else None
    words = ctx.call("cpu_affinity", "nvmlDeviceGetCpuAffinity", h, CPU_SET_WORDS)
    if words is not None:
        out["cpu_affinity"] = cpu_list(int(w) for w in words) or None
    for link in range(MAX_LINKS):
        key = f"nvlink_state:{link}"
        state = ctx.call(key, "nvmlDeviceGetNvLinkState", h, link, probe=True)
        if state is None and key in ctx.unsupported:
            break  # past the GPU's last link (or none at all)
        entry: NvLink = {
            "link": link,
            "state": _named(LINK_STATES, state),
            "remote_type": None,
            "remote_pci_bus_id": None,
            "peer_uuid": None,
        }
        if state is not None and state != 0:  # an inactive link has no remote end to ask about
            kind = ctx.call(
                f"nvlink_remote_type:{link}", "nvmlDeviceGetNvLinkRemoteDeviceType", h, link, probe=True
            )
            if kind is not None:
                entry["remote_type"] = cast(NvLinkRemoteType, REMOTE_TYPES.get(int(kind), "unknown"))
            pci = ctx.call(
                f"nvlink_remote_pci:{link}", "nvmlDeviceGetNvLinkRemotePciInfo", h, link, probe=True
            )
            bus = text(getattr(pci, "busId", "")) if pci is not None else ""
            if device_key(bus) is not None:  # FFFFFFFF:FF:FF.0 or empty: NVML does not know
                entry["remote_pci_bus_id"] = bus
                entry["peer_uuid"] = by_bus.get(device_key(bus))
        out["nvlinks"].append(entry)


def _named(names: dict[int, str], value: Any) -> NvLinkState | None:
    if value is None:
        return None
    return cast(NvLinkState, names.get(int(value), "unknown"))


def _pair(ctx_a: DeviceContext, ctx_b: DeviceContext, a: int, b: int, errors: NvmlErrors) -> GpuPair:
    pair: GpuPair = {"gpu_a": a, "gpu_b": b, "pcie_ancestor": None, "nvlink_p2p": None}
    try:
        level = ctx_a.call(
            "common_ancestor", "nvmlDeviceGetTopologyCommonAncestor", ctx_a.handle, ctx_b.handle
        )
        if level is not None:
            pair["pcie_ancestor"] = cast(PcieAncestorLevel, LEVELS.get(int(level), "unknown"))
        status = ctx_a.call(
            "p2p_nvlink", "nvmlDeviceGetP2PStatus", ctx_a.handle, ctx_b.handle, P2P_CAPS_NVLINK
        )
        if status is not None:
            pair["nvlink_p2p"] = int(status) == P2P_STATUS_OK
    except errors.lost:
        pass  # one of the two fell off the bus meanwhile: the source reports it
    return pair
