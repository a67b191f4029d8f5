"""The GPUs an :class:`~gpupipe_producer.nvml.source.NvmlSource` knows, and what the rest of the producer
asks about them (kubelet matching, kernel-log attribution, MIG lookups, what NVML refused).

The source opens and polls the GPUs; the table holds them. It is read from other threads than
the polling one (the event watcher, the main loop, a metrics scrape): the list is replaced whole,
never edited in place, and the reads take snapshots and never call NVML.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gpupipe.domain import pci
from gpupipe_producer.nvml.base import DeviceContext
from gpupipe_producer.nvml.mig import MigSlice
from gpupipe_producer.nvml.records import DeviceIds, GpuRef


class Gpu:
    """One GPU of the node: its whole-GPU context, identity fields, MIG slices and lost state."""

    __slots__ = ("ctx", "identity", "lost", "minor", "next_probe", "slices")

    def __init__(self, ctx: DeviceContext) -> None:
        self.ctx = ctx
        self.identity: dict[str, Any] = {}
        self.slices: list[MigSlice] = []
        self.lost = False
        self.next_probe = 0.0
        self.minor: int | None = None

    def contexts(self) -> tuple[DeviceContext, ...]:
        """The whole GPU's context, then one per MIG slice."""
        return (self.ctx, *(s.ctx for s in self.slices))


class GpuTable:
    """The GPU list, the driver version their references carry, and the last XID per device."""

    def __init__(self) -> None:
        self.entries: list[Gpu] = []  # replaced whole (see the module docstring)
        self.driver_version: str | None = None
        self._last_xid: dict[tuple[int, int | None], int] = {}

    def ref(self, gpu: Gpu) -> GpuRef:
        c = gpu.ctx
        return GpuRef(c.index, c.uuid, c.pci_bus_id, c.model_name, self.driver_version, gpu.minor)

    def any_lost(self) -> bool:
        return any(g.lost for g in self.entries)

    def last_xid(self, gpu_index: int, gpu_instance_id: int | None = None) -> int | None:
        """The newest XID recorded for a GPU (``gpu_instance_id`` None) or one of its slices."""
        return self._last_xid.get((gpu_index, gpu_instance_id))

    def device_ids(self) -> DeviceIds:
        """What kubelet matching needs beyond UUIDs: minor numbers and MIG slice aliases."""
        minors: dict[str, int] = {}
        mig: dict[str, str] = {}
        aliases: dict[str, tuple[str, ...]] = {}
        for g in list(self.entries):
            if g.ctx.uuid and g.minor is not None:
                minors[g.ctx.uuid] = g.minor
            for s in list(g.slices):
                forms = []
                if s.mig_index >= 0:
                    mig[s.mig_uuid] = f"{g.ctx.index}:{s.mig_index}"
                    forms.append(mig[s.mig_uuid])
                if g.minor is not None and s.gpu_instance_id is not None:
                    forms.append(f"nvidia{g.minor}/gi{s.gpu_instance_id}")  # GKE's MIG device ids
                aliases[s.mig_uuid] = tuple(forms)
        return DeviceIds(minors, mig, aliases)

    def dra_device_uuid(self, driver: str, pool: str, device: str) -> str | None:
        """The GPU UUID of an NVIDIA DRA driver device name ``gpu-<n>`` (whole GPUs only).

        Current drivers name a GPU by its minor number, older ones by its index: the minor is
        tried first. MIG devices (``gpu-<n>-mig-...``) carry a placement NVML's handles here do
        not expose, so they stay unresolved (counted by the agent) rather than guessed.
        """
        if not device.startswith("gpu-") or not device[4:].isdigit():
            return None
        n = int(device[4:])
        refs = [self.ref(g) for g in self.entries]
        for r in refs:
            if r.minor == n:
                return r.uuid or None
        for r in refs:
            if r.minor is None and r.gpu_index == n:
                return r.uuid or None
        return None

    def refs(self) -> list[GpuRef]:
        """Every GPU the source knows (lost ones included)."""
        return [self.ref(g) for g in self.entries]

    def lost_refs(self) -> list[GpuRef]:
        """The GPUs currently reported lost."""
        return [self.ref(g) for g in self.entries if g.lost]

    def bus_id_map(self) -> dict[str, GpuRef]:
        """PCI bus id -> GPU for kernel-log attribution.

        Keys are :func:`gpupipe.domain.pci.device_key` (``0000:3b:00``);
        normalise the kernel's ``PCI:0000:3b:00`` the same way before looking it up.
        """
        out: dict[str, GpuRef] = {}
        for g in self.entries:
            key = pci.device_key(g.ctx.pci_bus_id) if g.ctx.pci_bus_id else None
            if key is not None:
                out[key] = self.ref(g)
        return out

    def mig_uuid_for(
        self, uuid: str, gpu_instance_id: int | None, compute_instance_id: int | None
    ) -> str | None:
        """The MIG device UUID of a GPU/compute instance of GPU ``uuid``, when known."""
        if gpu_instance_id is None:
            return None
        for g in self.entries:
            if g.ctx.uuid != uuid:
                continue
            for s in g.slices:
                if s.gpu_instance_id == gpu_instance_id and (
                    compute_instance_id is None or s.compute_instance_id == compute_instance_id
                ):
                    return s.mig_uuid
        return None

    def record_xid(self, gpu_index: int, xid: int, gpu_instance_id: int | None = None) -> None:
        """Remember an XID for ``last_xid`` on the GPU's (and the attributed slice's) samples.

        Thread-safe enough for the event watcher's thread (single dict assignments).
        """
        self._last_xid[(gpu_index, None)] = int(xid)
        if gpu_instance_id is not None:
            self._last_xid[(gpu_index, gpu_instance_id)] = int(xid)

    def unsupported(self, gpu_index: int, gpu_instance_id: int | None = None) -> frozenset[str]:
        """The call keys learned as unsupported for a GPU (or one of its slices)."""
        for g in self.entries:
            if g.ctx.index != gpu_index:
                continue
            if gpu_instance_id is None:
                return frozenset(g.ctx.unsupported)
            for s in g.slices:
                if s.gpu_instance_id == gpu_instance_id:
                    return frozenset(s.ctx.unsupported)
        return frozenset()

    def learned(self) -> Counter[tuple[str, str]]:
        """(call, refusal kind) -> how many device contexts have it learned now (the
        ``gpupipe_producer_nvml_learned`` gauge): tells "no ECC here" from "the agent lacks rights"."""
        out: Counter[tuple[str, str]] = Counter()
        for g in list(self.entries):
            ctxs: list[DeviceContext] = [g.ctx, *(s.ctx for s in list(g.slices))]
            for ctx in ctxs:
                for key, kind in ctx.unsupported.kinds().items():
                    out[(key.split(":", 1)[0], kind)] += 1
        return out
