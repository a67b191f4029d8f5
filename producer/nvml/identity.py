"""Identity of a GPU: read when the source starts (and again after a lost GPU comes back).

Fields: ``uuid``, ``model_name``, ``pci_bus_id``, ``numa_node``, ``mig_enabled``; and two
capabilities the other collectors consult through the context: MIG mode (``ctx.mig_enabled``)
and GPM support (``ctx.gpm_supported``, Hopper or newer).
"""

from __future__ import annotations

import re
from typing import Any

from producer.nvml.base import DeviceContext

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?$")


def text(value: Any) -> str:
    """pynvml returns str (13.x decodes char arrays); older bindings and structs may give bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def normalize_pci_bus_id(bus_id: str) -> str | None:
    """Canonical key ``dddd:bb:dd`` (lower-case hex, 4-digit domain, no function) for a PCI bus id.

    Accepts NVML's ``00000000:3B:00.0``, the kernel log's ``0000:3b:00`` (``PCI:`` prefix
    allowed) and ``3b:00.0``; returns None when ``bus_id`` is not a PCI address.
    """
    s = bus_id.strip()
    if s[:4].upper() == "PCI:":
        s = s[4:]
    m = _BUS_ID.match(s)
    if m is None:
        return None
    domain = int(m[1], 16) if m[1] else 0
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{int(m[2], 16):02x}:{int(m[3], 16):02x}"


def read_driver_version(nvml: Any) -> str | None:
    """The driver version, or None; never raises an NVML error."""
    try:
        return text(nvml.nvmlSystemGetDriverVersion()) or None
    except (nvml.NVMLError, AttributeError):
        return None


class IdentityCollector:
    """Reads who a GPU is; run once per GPU at start (and when a lost GPU is found again)."""

    name = "identity"
    fields = ("uuid", "model_name", "pci_bus_id", "numa_node", "mig_enabled")

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
        numa = ctx.call("numa", "nvmlDeviceGetNumaNodeId", h)
        if isinstance(numa, int) and 0 <= numa < 2**31:
            out["numa_node"] = numa  # -1: the platform does not say
        ctx.mig_enabled = out["mig_enabled"] = self._mig_mode(ctx)
        ctx.gpm_supported = self._gpm_support(ctx)
        return out

    @staticmethod
    def _mig_mode(ctx: DeviceContext) -> bool | None:
        mode = ctx.call("mig_mode", "nvmlDeviceGetMigMode", ctx.handle)
        if mode is None:
            # Not MIG-capable (NotSupported): known not to be in MIG mode. Other errors: unknown.
            return False if "mig_mode" in ctx.unsupported else None
        try:
            return int(mode[0]) == int(getattr(ctx.nvml, "NVML_DEVICE_MIG_ENABLE", 1))
        except (TypeError, ValueError, IndexError):
            return None

    @staticmethod
    def _gpm_support(ctx: DeviceContext) -> bool | None:
        support = ctx.call("gpm", "nvmlGpmQueryDeviceSupport", ctx.handle)
        if support is None:
            return False if "gpm" in ctx.unsupported else None
        ok = bool(getattr(support, "isSupportedDevice", 0))
        if not ok:
            ctx.learn("gpm", "nvmlGpmQueryDeviceSupport: isSupportedDevice=0 (pre-Hopper)")
        return ok

    def release(self, ctx: DeviceContext) -> None:
        return None
