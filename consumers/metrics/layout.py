"""Where series go: gpupipe's per-pod share families, dcgm-exporter's virtual-GPU split and the MIG
instance layout (pure data and one pure function; see :mod:`gpupipe_consumers.metrics.render`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpupipe_consumers.metrics.fields import FIELDS, Kind
from gpupipe_schemas.records import GPU_SAMPLE_MIG_OWN

#: gpupipe's per-pod share families: (name, GpuProcess field, kind, HELP).
SHARE_FAMILIES: tuple[tuple[str, str, Kind, str], ...] = (
    (
        "gpupipe_pod_gpu_util_percent",
        "sm_util_ratio",
        Kind.PERCENT,
        "Share of a shared GPU's SM time used by the pod's processes (in %).",
    ),
    (
        "gpupipe_pod_mem_copy_util_percent",
        "mem_util_ratio",
        Kind.PERCENT,
        "Share of a shared GPU's memory-controller time used by the pod's processes (in %).",
    ),
    (
        "gpupipe_pod_fb_used_mib",
        "used_memory_bytes",
        Kind.MIB,
        "Framebuffer memory used by the pod's processes on a shared GPU (in MiB).",
    ),
)
#: dcgm-exporter splits only these two per process in virtual-GPU mode (process_metrics.go).
VGPU_SPLIT = frozenset({"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"})

#: Sample fields a MIG instance takes from its parent GPU in the ``instances`` layout: device-wide
#: readings DCGM reports on every GPU instance (clocks, temperatures, power, energy, errors...).
#: Utilisation, framebuffer and profiling fields are the instance's own, never inherited (the
#: schema marks them ``gpupipe.mig: own``).
MIG_NOT_INHERITED = frozenset(GPU_SAMPLE_MIG_OWN)


def merge_parent(instance: Mapping[str, Any], parent: Mapping[str, Any]) -> dict[str, Any]:
    """A MIG instance's sample with its parent GPU's device-wide readings where it has none."""
    out = dict(instance)
    for k, v in parent.items():
        if v is not None and out.get(k) is None and k not in MIG_NOT_INHERITED and k in _INHERITABLE:
            out[k] = v
    return out


def _inheritable() -> frozenset[str]:
    return frozenset(f.source for f in FIELDS if f.source and f.kind is not Kind.LABEL) | {"last_xid"}


_INHERITABLE = _inheritable()
