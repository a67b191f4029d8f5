"""Identity of a GPU: read when the source starts (and again after a lost GPU comes back).

Fields: ``uuid``, ``model_name``, ``pci_bus_id``, ``numa_node``, ``mig_enabled``; and two
capabilities the other collectors consult through the context: MIG mode (``ctx.mig_enabled``)
and GPM support (``ctx.gpm_supported``, Hopper or newer).
"""

from __future__ import annotations

import os
from typing import Any

from gpupipe.domain.pci import device_key
from gpupipe_producer.nvml.base import DeviceContext

#: Where the kernel shows each PCI device (numa_node: the node it is attached to).
SYSFS_PCI_DEVICES = "/sys/bus/pci/devices"


def text(value: Any) -> str:
    """pynvml returns str (13.x decodes char arrays); older bindings and structs may give bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def read_driver_version(nvml: Any) -> str | None:
    """The driver version, or None; never raises an NVML error."""
    try:
        return text(nvml.nvmlSystemGetDriverVersion()) or None
    except (nvml.NVMLError, AttributeError):
        return None


#: nvmlBrandType -> the words nvidia-smi prints as "Product Brand" (DCGM_FI_DEV_BRAND's label value).
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NVIDIA Virtual Applications",
    8: "NVIDIA Virtual PC",
    9: "NVIDIA Virtual Compute Server",
    10: "NVIDIA RTX Virtual Workstation",
    11: "NVIDIA Cloud Gaming",
    12: "Quadro RTX",
    13: "NVIDIA RTX",
    14: "NVIDIA",
    15: "GeForce RTX",
    16: "TITAN RTX",
}


def read_nvml_version(nvml: Any) -> str | None:
    """The NVML library version (DCGM_FI_NVML_VERSION's label value), or None; never raises."""
    try:
        return text(nvml.nvmlSystemGetNVMLVersion()) or None
    except (nvml.NVMLError, AttributeError):
        return None


def attached_numa_node(ctx: DeviceContext, sysfs_pci: str = SYSFS_PCI_DEVICES) -> int | None:
    """The CPU-side NUMA node the GPU is attached to (the schema's meaning) on every platform.

    Not ``nvmlDeviceGetNumaNodeId``: that is the GPU's *own* NUMA node where GPU memory is
    onlined as one (GH200/GB200) and NotSupported on x86 HGX. The kernel's PCI view
    (``/sys/bus/pci/devices/<bdf>/numa_node``) first, else NVML's memory affinity at node
    scope when it names exactly one node; -1 or several nodes: null (unknown).
    """
    bdf = device_key(ctx.pci_bus_id or "")
    if bdf is not None:
        try:
            with open(os.path.join(sysfs_pci, bdf + ".0", "numa_node")) as fh:
                node = int(fh.read().strip())
            return node if node >= 0 else None
        except (OSError, ValueError):
            pass
    scope = getattr(ctx.nvml, "NVML_AFFINITY_SCOPE_NODE", 0)
    mask = ctx.call("numa_affinity", "nvmlDeviceGetMemoryAffinity", ctx.handle, 1, scope)
    try:
        bits = int(mask[0]) if mask is not None else 0
    except (TypeError, ValueError, IndexError):
        return None
    if bits <= 0 or bits & (bits - 1) or bits >= 1 << 63:
        return None
    return bits.bit_length() - 1


class IdentityCollector:
    """Reads who a GPU is; run once per GPU at start (and when a lost GPU is found again)."""

    name = "identity"
    fields = (
        "uuid",
        "model_name",
        "pci_bus_id",
        "numa_node",
        "mig_enabled",
        "serial",
        "vbios_version",
        "brand",
        "inforom_image_version",
    )

    def __init__(self, sysfs_pci: str = SYSFS_PCI_DEVICES) -> None:
        self.sysfs_pci = sysfs_pci

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        h = ctx.handle
        out: dict[str, Any] = {}
        uuid = ctx.call("uuid", "nvmlDeviceGetUUID", h)
        if uuid is not None:
            ctx.uuid = out["uuid"] = text(uuid)
        name = ctx.call("name", "nvmlDeviceGetName", h)
        if name is not None:
            ctx.model_name = out["model_name"] = text(name)
        pci = ctx.call("pci", "nvmlDeviceGetPciInfo", h)
        if pci is not None:
            ctx.pci_bus_id = out["pci_bus_id"] = text(pci.busId)
        numa = attached_numa_node(ctx, self.sysfs_pci)
        if numa is not None:
            out["numa_node"] = numa
        # Label rows of dcgm-exporter (serial, VBIOS, brand, InfoROM image): read once, never fatal.
        for key, fn in (
            ("serial", "nvmlDeviceGetSerial"),
            ("vbios_version", "nvmlDeviceGetVbiosVersion"),
            ("inforom_image_version", "nvmlDeviceGetInforomImageVersion"),
        ):
            value = ctx.call(key, fn, h)
            if value is not None and text(value):
                out[key] = text(value)
        brand = ctx.call("brand", "nvmlDeviceGetBrand", h)
        if brand is not None:
            out["brand"] = BRANDS.get(brand if isinstance(brand, int) else -1, "Unknown")
        ctx.mig_enabled = out["mig_enabled"] = self._mig_mode(ctx)
        ctx.gpm_supported = self._gpm_support(ctx)
        return out

    @staticmethod
    def _mig_mode(ctx: DeviceContext) -> bool | None:
        mode = ctx.call("mig_mode", "nvmlDeviceGetMigMode", ctx.handle)
        if mode is None:
            # Not MIG-capable (NotSupported): known not to be in MIG mode. Other errors: unknown.
            return False if ctx.unsupported.permanent("mig_mode") else None
        try:
            return int(mode[0]) == int(getattr(ctx.nvml, "NVML_DEVICE_MIG_ENABLE", 1))
        except (TypeError, ValueError, IndexError):
            return None

    @staticmethod
    def _gpm_support(ctx: DeviceContext) -> bool | None:
        support = ctx.call("gpm", "nvmlGpmQueryDeviceSupport", ctx.handle)
        if support is None:
            return False if ctx.unsupported.permanent("gpm") else None
        ok = bool(getattr(support, "isSupportedDevice", 0))
        if not ok:
            ctx.learn("gpm", "nvmlGpmQueryDeviceSupport: isSupportedDevice=0 (pre-Hopper)")
        return ok

    def release(self, ctx: DeviceContext) -> None:
        return None
