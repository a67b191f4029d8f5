"""Parsers for the driver's XID message texts (containment flags, recovery action, NVLink registers).

Pure functions of the message; the rules in the ``rules_*`` modules call them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpupipe_consumers.alerts.rules.catalog import (
    Action,
)

# ------------------------------------------------------------------------------------ message parsers


@dataclass(frozen=True, slots=True)
class Containment:
    """Xid 94/95 body: ``<Contained|Uncontained>: <unit> (...). RST: <Yes|No>, D-RST: <Yes|No>`` [SRC]."""

    contained: bool
    unit: str
    gpu_reset_required: bool | None
    drain_and_reset_required: bool | None


_CONTAINMENT_RE = re.compile(r"\b(?P<kind>Uncontained|Contained):\s*(?P<unit>[^(.]*)", re.IGNORECASE)
_RST_RE = re.compile(r"(?<![-\w])RST:\s*(?P<v>Yes|No)\b", re.IGNORECASE)
_DRST_RE = re.compile(r"\bD-RST:\s*(?P<v>Yes|No)\b", re.IGNORECASE)


def parse_containment(message: str) -> Containment | None:
    m = _CONTAINMENT_RE.search(message)
    if m is None:
        return None
    rst = _RST_RE.search(message)
    drst = _DRST_RE.search(message)
    return Containment(
        contained=m.group("kind").lower() == "contained",
        unit=m.group("unit").strip(),
        gpu_reset_required=None if rst is None else rst.group("v").lower() == "yes",
        drain_and_reset_required=None if drst is None else drst.group("v").lower() == "yes",
    )


@dataclass(frozen=True, slots=True)
class RecoveryChange:
    """Xid 154 body: ``GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)``."""

    from_value: int
    from_name: str
    to_value: int
    to_name: str
    action: Action | None
    """``to`` mapped to an action; ``None`` when neither its name nor its value is recognised."""


_RECOVERY_RE = re.compile(
    r"recovery action changed from\s+(?P<fv>0x[0-9a-f]+|\d+)\s*(?:\((?P<fn>[^)]*)\))?"
    r"\s*to\s+(?P<tv>0x[0-9a-f]+|\d+)\s*(?:\((?P<tn>[^)]*)\))?",
    re.IGNORECASE,
)
# [CAT] Xid 154: the expected texts are "None", "Drain P2P", "Drain and Reset", "GPU Reset Required",
# "Node Reboot Required".
_RECOVERY_TEXT = {
    "none": Action.IGNORE,
    "drain p2p": Action.DRAIN_P2P,
    "drain and reset": Action.DRAIN_AND_RESET,
    "gpu reset required": Action.RESET_GPU,
    "node reboot required": Action.RESTART_BM,
}
# NVML_GPU_RECOVERY_ACTION_* values (nvml-telemetry.md): 0 NONE, 1 GPU_RESET, 2 NODE_REBOOT, 3 DRAIN_P2P,
# 4 DRAIN_AND_RESET; R615 adds 6 BUS_RESET ("reset the GPU's PCIe bus") and 7 SYSTEM_REBOOT ("reboot
# the system"), kept apart from 1 and 2 so the operator is told which. 5 (RECOVER_IMEX_DOMAIN) has no
# bucket here and stays unmapped.
_RECOVERY_NVML = {
    0: Action.IGNORE,
    1: Action.RESET_GPU,
    2: Action.RESTART_BM,
    3: Action.DRAIN_P2P,
    4: Action.DRAIN_AND_RESET,
    6: Action.BUS_RESET,
    7: Action.SYSTEM_REBOOT,
}


def recovery_action_from_nvml(value: int) -> Action | None:
    """Map an ``NVML_GPU_RECOVERY_ACTION_*`` value to an action; ``None`` if unrecognised."""
    return _RECOVERY_NVML.get(value)


# nvmlGpuRecoveryAction_t names (nvml.h; nvidia-ml-py 13.615): what the producer writes in a
# recovery-action event's message, "GPU recovery action: DRAIN_AND_RESET (4)" (gpupipe_producer.xid.events).
RECOVERY_ACTION_NAMES = {
    "NONE": 0,
    "GPU_RESET": 1,
    "NODE_REBOOT": 2,
    "DRAIN_P2P": 3,
    "DRAIN_AND_RESET": 4,
    "RECOVER_IMEX_DOMAIN": 5,
    "BUS_RESET": 6,
    "SYSTEM_REBOOT": 7,
}
_RECOVERY_EVENT_RE = re.compile(
    r"recovery action:\s*(?P<name>[A-Za-z0-9_]+)?\s*(?:\(\s*(?P<value>\d+)\s*\))?", re.IGNORECASE
)


def parse_recovery_event(message: str) -> int | None:
    """The ``nvmlGpuRecoveryAction_t`` value of a recovery-action XidEvent's message, ``None`` if absent.

    The XidEvent has no field for NVML's event data, so the producer writes it into the message as
    ``GPU recovery action: <NAME> (<value>)``; the number wins, the name is the fallback (a value the
    producer had no name for is written ``UNKNOWN (<value>)``)."""
    m = _RECOVERY_EVENT_RE.search(message)
    if m is None:
        return None
    if m.group("value") is not None:
        return int(m.group("value"))
    return RECOVERY_ACTION_NAMES.get((m.group("name") or "").upper())


def parse_recovery_action(message: str) -> RecoveryChange | None:
    m = _RECOVERY_RE.search(message)
    if m is None:
        return None
    to_value = int(m.group("tv"), 0)
    to_name = (m.group("tn") or "").strip()
    action = _RECOVERY_TEXT.get(" ".join(to_name.lower().split()))
    if action is None:
        action = recovery_action_from_nvml(to_value)
    return RecoveryChange(
        from_value=int(m.group("fv"), 0),
        from_name=(m.group("fn") or "").strip(),
        to_value=to_value,
        to_name=to_name,
        action=action,
    )


@dataclass(frozen=True, slots=True)
class NvlinkError:
    """Xid 74 body: ``NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)``."""

    link: int
    registers: tuple[int, ...]
    """The hex fields in order (the catalog expects seven); empty when the line carries none."""


_NVLINK_LINK_RE = re.compile(r"\blink\s+(?P<link>\d+)\s*(?:\((?P<regs>[^)]*)\))?", re.IGNORECASE)
_HEX_RE = re.compile(r"0x[0-9a-f]+", re.IGNORECASE)


def parse_nvlink_error(message: str) -> NvlinkError | None:
    m = _NVLINK_LINK_RE.search(message)
    if m is None:
        return None
    regs = tuple(int(h, 16) for h in _HEX_RE.findall(m.group("regs") or ""))
    return NvlinkError(link=int(m.group("link")), registers=regs)


# WORKFLOW_NVLINK_ERR [CAT]: which bits of which register (0-based: first register = 0) mean what.
_NVL_BITS: dict[str, dict[int, frozenset[int]]] = {
    "ignorable": {0: frozenset({0, 23, 30})},
    "sympathetic": {0: frozenset({1, 20}), 3: frozenset({16, 17})},
    "fabric_reset": {3: frozenset({18})},
    "ecc_parity": {
        0: frozenset({4, 5}),
        2: frozenset({0, 1, 2, 6}),
        4: frozenset({18, 19, 21, 22, 24, 25, 27, 28}),
    },
    "mechanical": {0: frozenset({8, 9, 12, 16, 17, 24, 28})},
    "marginal_si": {0: frozenset({21, 22})},
    "report_if_repeated": {0: frozenset({27, 29}), 2: frozenset({16, 17, 18, 19})},
    "not_expected": {2: frozenset({13})},
    "ecc_threshold": {4: frozenset({20, 23, 26, 29})},
}


def decode_nvlink_registers(registers: Iterable[int]) -> dict[str, list[str]]:
    """Group the set bits of Xid 74's registers by the catalog's guidance (WORKFLOW_NVLINK_ERR, [CAT]).

    Returns ``{category: ["r1.b4", ...]}`` for categories with at least one set bit; register numbers
    are 1-based as in the catalog. Bits the catalog does not describe land in ``undocumented`` (the
    catalog says: report a bug).
    """
    out: dict[str, list[str]] = {}
    for reg_index, value in enumerate(registers):
        for bit in range(value.bit_length()):
            if not value >> bit & 1:
                continue
            label = f"r{reg_index + 1}.b{bit}"
            category = next((c for c, regs in _NVL_BITS.items() if bit in regs.get(reg_index, ())), None)
            out.setdefault(category or "undocumented", []).append(label)
    return out


@dataclass(frozen=True, slots=True)
class Nvlink5Error:
    """Xid 144-150 body: ``<unit> <Fatal|Nonfatal> <XC> <injected> Link <n> (<intrInfo> <errorStatus> ..)``.

    [CAT] WORKFLOW_NVLINK5_ERR message format.
    """

    unit: str
    fatal: bool
    link: int
    intr_info: int | None
    error_status: int | None


_NVLINK5_RE = re.compile(
    r"\b(?P<unit>[A-Z][A-Z0-9_/]*)\s+(?P<sev>Fatal|Non-?fatal)\b.*?\bLink\s+(?P<link>-?\d+)"
    r"(?:\s*[(\[]\s*(?P<intr>0x[0-9a-fA-F]+)(?:\s+(?P<status>0x[0-9a-fA-F]+))?)?",
    re.IGNORECASE,
)


def parse_nvlink5(message: str) -> Nvlink5Error | None:
    m = _NVLINK5_RE.search(message)
    if m is None:
        return None
    return Nvlink5Error(
        unit=m.group("unit").upper(),
        fatal=m.group("sev").lower() == "fatal",
        link=int(m.group("link")),
        intr_info=int(m.group("intr"), 16) if m.group("intr") else None,
        error_status=int(m.group("status"), 16) if m.group("status") else None,
    )
