"""MIG: enumerate the slices of a GPU in MIG mode and say which profile each one is.

The profile comes from the MIG device's name, which NVML formats as
``"<parent name> MIG <profile>"`` (``NVIDIA H100 80GB HBM3 MIG 3g.40gb``; a compute instance
smaller than its GPU instance reads ``MIG 1c.3g.40gb``). That works without privileges, unlike
the GPU-instance calls. The slice fraction is the slice's compute slices over the GPU's maximum
(7 on A100/H100/H200, 4 on A30), the latter probed once per GPU through
``nvmlDeviceGetGpuInstanceProfileInfo`` with the largest full-GPU profile it accepts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpupipe_producer.nvml.base import DeviceContext
from gpupipe_producer.nvml.identity import text

_PROFILE = re.compile(r"\bMIG\s+(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<mem>\S+)\s*$")
DEFAULT_MAX_SLICES = 7
NO_INSTANCE = 0xFFFFFFFF
# Full-GPU profile constants to probe, largest first, with their slice counts.
_FULL_PROFILES = (
    ("NVML_GPU_INSTANCE_PROFILE_8_SLICE", 8),
    ("NVML_GPU_INSTANCE_PROFILE_7_SLICE", 7),
    ("NVML_GPU_INSTANCE_PROFILE_6_SLICE", 6),
    ("NVML_GPU_INSTANCE_PROFILE_4_SLICE", 4),
    ("NVML_GPU_INSTANCE_PROFILE_3_SLICE", 3),
    ("NVML_GPU_INSTANCE_PROFILE_2_SLICE", 2),
)


@dataclass(frozen=True, slots=True)
class MigProfile:
    profile: str  # GPU-instance profile, e.g. "3g.40gb" (dcgm-exporter's GPU_I_PROFILE)
    slices: int  # compute slices this device holds (the "c" count when smaller than the GI)


def parse_mig_profile(device_name: str) -> MigProfile | None:
    """``"NVIDIA H100 80GB HBM3 MIG 3g.40gb"`` -> ``MigProfile("3g.40gb", 3)``; None if no profile."""
    m = _PROFILE.search(device_name)
    if m is None:
        return None
    g = int(m["g"])
    c = int(m["c"]) if m["c"] else g
    return MigProfile(f"{g}g.{m['mem']}", c)


def slice_fraction(slices: int, max_slices: int) -> float:
    if max_slices <= 0:
        max_slices = DEFAULT_MAX_SLICES
    return min(max(slices / max_slices, 0.0), 1.0)


def max_slices(ctx: DeviceContext) -> int:
    """The GPU's slice count (7 on A100/H100/H200), probed once and cached on the context."""
    cached = ctx.state.get("mig_max_slices")
    if cached is not None:
        return cached
    nvml = ctx.nvml
    found = DEFAULT_MAX_SLICES
    fn = getattr(nvml, "nvmlDeviceGetGpuInstanceProfileInfo", None)
    if fn is not None:
        for const_name, default_count in _FULL_PROFILES:
            const = getattr(nvml, const_name, None)
            if const is None:
                continue
            try:
                info = fn(ctx.handle, const)
            except ctx.errors.lost:
                raise
            except ctx.errors.base:
                continue  # NotSupported / InvalidArgument: this GPU has no such profile
            count = int(getattr(info, "sliceCount", 0) or default_count)
            if count > 0:
                found = count
                break
    ctx.state["mig_max_slices"] = found
    return found


@dataclass(slots=True)
class MigSlice:
    """One MIG device found under a parent GPU."""

    ctx: DeviceContext
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    slice_fraction: float
    #: Position under the parent (nvmlDeviceGetMigDeviceHandleByIndex): the device plugin's
    #: ``deviceIDStrategy=index`` names the slice ``<gpu index>:<mig index>``.
    mig_index: int = -1

    def identity(self) -> dict[str, Any]:
        return {
            "mig_uuid": self.mig_uuid,
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
            "profile": self.profile,
            "slice_fraction": self.slice_fraction,
        }


def enumerate_slices(
    parent: DeviceContext,
    make_ctx: Callable[[Any, int, int], DeviceContext],
    previous: dict[str, MigSlice] | None = None,
) -> list[MigSlice]:
    """The MIG devices of ``parent`` (empty when not in MIG mode or not MIG-capable).

    ``make_ctx(handle, gpu_instance_id, compute_instance_id)`` builds the slice context; a slice
    already known (same MIG UUID in ``previous``) keeps its context, so its learned-unsupported
    set and GPM samples survive the refresh, with the fresh handle swapped in.
    """
    if not parent.mig_enabled:
        return []
    count = parent.call("mig_count", "nvmlDeviceGetMaxMigDeviceCount", parent.handle)
    if not count:
        return []
    nvml = parent.nvml
    out: list[MigSlice] = []
    limit = max_slices(parent)
    for i in range(int(count)):
        try:
            h = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent.handle, i)
        except parent.errors.lost:
            raise
        except parent.errors.not_found:
            continue  # an empty index: no MIG device there
        except parent.errors.base as exc:
            parent.reporter.error(type(exc).__name__)
            continue
        try:
            mig_uuid = text(nvml.nvmlDeviceGetUUID(h))
            gi = int(nvml.nvmlDeviceGetGpuInstanceId(h))
            ci = int(nvml.nvmlDeviceGetComputeInstanceId(h))
            name = text(nvml.nvmlDeviceGetName(h))
        except parent.errors.lost:
            raise
        except parent.errors.base as exc:
            parent.reporter.error(type(exc).__name__)
            continue
        prof = parse_mig_profile(name)
        if prof is None:
            parent.reporter.error("MigProfileUnparsable")
            prof = MigProfile("unknown", 0)
        known = (previous or {}).get(mig_uuid)
        if known is not None and known.gpu_instance_id == gi and known.compute_instance_id == ci:
            known.ctx.handle = h
            known.profile = prof.profile
            known.slice_fraction = slice_fraction(prof.slices, limit)
            known.mig_index = i
            out.append(known)
            continue
        ctx = make_ctx(h, gi, ci)
        ctx.uuid = mig_uuid
        ctx.model_name = parent.model_name
        ctx.pci_bus_id = parent.pci_bus_id
        ctx.gpm_supported = parent.gpm_supported
        out.append(MigSlice(ctx, mig_uuid, gi, ci, prof.profile, slice_fraction(prof.slices, limit), i))
    return out
