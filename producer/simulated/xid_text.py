"""Driver message texts for simulated XIDs, shaped like the kernel log's, and their rates."""

from __future__ import annotations

# Relative frequency of each code among XIDs seen in large fleets: application
# faults (13, 31, 43) dominate; bus loss (79) and uncontained ECC (95) are rare.
XID_WEIGHTS: dict[int, int] = {13: 25, 31: 25, 43: 15, 48: 3, 63: 5, 74: 4, 79: 2, 94: 8, 95: 3, 119: 10}

MESSAGES: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    31: "Ch 00000010, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. "
    "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000008",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 2, "
    "subpartition 0.",
    63: "Row Remapper: New row (0x0000000000003a21) was marked for remapping, reset gpu to activate.",
    74: "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) "
    "(0x20800a4c 0x4).",
}

# Codes the driver attributes to a process (pid/name present in the kernel log line).
WITH_PROCESS = frozenset({13, 31, 43, 94, 95})
