"""PCI bus ids: the one place that parses and spells them, so the kernel log's, NVML's and NVSwitch's
spellings of one device compare equal.

The same GPU is ``00000000:3B:00.0`` to NVML, ``0000:3b:00`` (or ``PCI:0000:3b:00``) in the driver's
Xid lines, ``0000:05:00.0`` for an NVSwitch in SXid lines and ``3b:00.0`` to ``lspci``. Each function
names the form it returns; pick by what the result is compared with:

* :func:`canonical` -> ``dddd:bb:dd.f``, raises ``ValueError``: one key per PCI function (the XID
  merge of NVML and kernel-log sightings, the alerts' device key);
* :func:`device_key` -> ``dddd:bb:dd`` or None: one key per device, no function, and the sysfs
  directory name without its ``.f`` (the producer's GPU-by-bus-id maps);
* :func:`nvml_form` -> ``DDDDDDDD:BB:DD.F``: what NVML prints, hence the ``pci_bus_id`` label the
  metrics service exposes (the input comes back unchanged when it is not a bus id).

Their acceptance differs at the edges (see each docstring);
``tests/unit/gpupipe/domain/test_pci.py`` pins each.
"""

from __future__ import annotations

import re

__all__ = ["canonical", "device_key", "nvml_form"]

_DEVICE_KEY = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?$")


def _without_prefix(bus_id: str) -> str:
    """Stripped, without the ``PCI:`` the driver's Xid lines put in front."""
    s = bus_id.strip()
    return s[4:] if s[:4].upper() == "PCI:" else s


def canonical(bus_id: str) -> str:
    """``dddd:bb:dd.f`` (lower case, at least 4 hex digits of domain, function default 0).

    Accepts what NVML (``00000000:3B:00.0``), the driver's Xid lines (``0000:3b:00``, ``PCI:0000:3b:00``),
    the NVSwitch driver (``0000:05:00.0``), sysfs and ``lspci`` (``3b:00.0``, no domain) print.
    Raises ``ValueError`` for anything else, including a device number above 0x1f.
    """
    s = _without_prefix(bus_id)
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


def device_key(bus_id: str) -> str | None:
    """``dddd:bb:dd`` (lower-case hex, 4-digit domain, no function), or None when not a bus id.

    Accepts NVML's ``00000000:3B:00.0``, the kernel log's ``0000:3b:00`` (``PCI:`` prefix allowed)
    and ``3b:00.0``; a domain above 0xffff gives None.
    """
    m = _DEVICE_KEY.match(_without_prefix(bus_id))
    if m is None:
        return None
    domain = int(m[1], 16) if m[1] else 0
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{int(m[2], 16):02x}:{int(m[3], 16):02x}"


def nvml_form(bus_id: str) -> str:
    """NVML's spelling ``DDDDDDDD:BB:DD.F`` (upper case, 8-digit domain) of ``0000:3b:00`` and the like.

    Anything that does not parse comes back unchanged (a label keeps what the record said).
    """
    s = bus_id.strip()
    try:
        head, _, func = s.partition(".")
        parts = head.split(":")
        if len(parts) == 2:
            parts.insert(0, "0")
        if len(parts) != 3:
            return bus_id
        domain, bus, dev = (int(p, 16) for p in parts)
        fn = int(func, 16) if func else 0
    except ValueError:
        return bus_id
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn:X}"
