"""PCI bus ids in one canonical form, so the kernel log's, NVML's and NVSwitch's spellings compare equal.

Shared by the producer (pairing NVML and kernel-log XIDs) and the alerts service (one device key per
GPU whichever source named it).
"""

from __future__ import annotations


def normalize_pci_bus_id(bus_id: str) -> str:
    """Canonical ``dddd:bb:dd.f`` (lower case, 4-hex domain, function default 0).

    Accepts what NVML (``00000000:3B:00.0``), the driver's Xid lines (``0000:3b:00``, ``PCI:0000:3b:00``),
    the NVSwitch driver (``0000:05:00.0``), sysfs and ``lspci`` (``3b:00.0``, no domain) print.
    Raises ``ValueError`` for anything else.
    """
    s = bus_id.strip()
    if s[:4].upper() == "PCI:":
        s = s[4:]
    parts = s.split(":")
    if len(parts) == 3:
        domain, bus, devfn = parts
    elif len(parts) == 2:
        domain, (bus, devfn) = "0", parts
    else:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    dev, _, fn = devfn.partition(".")
    fn = fn or "0"
    try:
        d, b, v, f = int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        raise ValueError(f"not a PCI bus id: {bus_id!r}") from None
    if (
        not domain
        or len(domain) > 8
        or not 0 < len(bus) <= 2
        or not 0 < len(dev) <= 2
        or len(fn) > 1
        or any(c in "+-_ " for c in s)
        or v > 0x1F
        or f > 7
    ):
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{d:04x}:{b:02x}:{v:02x}.{f}"
