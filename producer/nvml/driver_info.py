"""The NVIDIA driver's own list of GPUs (``/proc/driver/nvidia/gpus/<bus id>/information``).

Why: a GPU that NVML reports lost before the agent opened it has no handle, so NVML cannot say
which GPU it was; an event with an empty UUID and bus id tells an operator nothing. The driver's
procfs entry still names it. Entries are one directory per GPU named by PCI bus id; NVML numbers
GPUs in PCI bus order, so the n-th entry in bus order is NVML index n (true unless
``CUDA_VISIBLE_DEVICES``-style filtering hides GPUs from NVML, which the agent does not do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DRIVER_GPUS_DIR = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class DriverGpu:
    pci_bus_id: str  # NVML form: 00000000:3B:00.0
    uuid: str
    minor: int | None


def parse_information(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def nvml_bus_id(entry: str) -> str:
    """``0000:3b:00.0`` (procfs) -> ``00000000:3B:00.0`` (NVML)."""
    domain, _, rest = entry.partition(":")
    return f"{int(domain, 16):08X}:{rest.upper()}"


def driver_gpu(directory: str, index: int) -> DriverGpu | None:
    """The ``index``-th GPU in PCI bus order, or None when the driver's list is not readable."""
    try:
        entries = sorted(e for e in os.listdir(directory) if ":" in e)
    except OSError:
        return None
    if not 0 <= index < len(entries):
        return None
    entry = entries[index]
    try:
        with open(os.path.join(directory, entry, "information")) as fh:
            info = parse_information(fh.read())
    except OSError:
        info = {}
    minor = info.get("Device Minor", "")
    try:
        bus = nvml_bus_id(entry)
    except ValueError:
        return None
    return DriverGpu(bus, info.get("GPU UUID", ""), int(minor) if minor.isdigit() else None)
