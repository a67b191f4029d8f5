"""GPU models the simulated fleet is built from: datasheet-level constants only."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str
    power_limit_w: float
    idle_power_w: float
    fb_total_bytes: int
    fb_reserved_bytes: int
    sm_clock_max_mhz: int
    mem_clock_mhz: int
    hopper_or_newer: bool  # GPM profiling metrics exist
    mig_capable: bool
    driver_version: str


MODELS: tuple[GpuModel, ...] = (
    GpuModel(
        "NVIDIA H100 80GB HBM3", 700.0, 72.0, 80 * GIB, 531 * 1024**2, 1980, 2619, True, True, "570.124.06"
    ),
    GpuModel("NVIDIA H200", 700.0, 76.0, 141 * GIB, 590 * 1024**2, 1980, 3201, True, True, "570.124.06"),
    GpuModel(
        "NVIDIA A100-SXM4-80GB", 400.0, 58.0, 80 * GIB, 463 * 1024**2, 1410, 1593, False, True, "550.127.05"
    ),
    GpuModel("NVIDIA L40S", 350.0, 34.0, 48 * GIB, 420 * 1024**2, 2520, 9001, False, False, "550.127.05"),
)
# Share of nodes of each model in a typical mixed training/inference cluster.
MODEL_WEIGHTS = (0.40, 0.25, 0.20, 0.15)

# (profile, slices of 7) pairs that fully partition one MIG-capable GPU into two slices.
MIG_LAYOUT = (("4g.40gb", 4), ("3g.40gb", 3))
MIG_LAYOUT_H200 = (("4g.71gb", 4), ("3g.71gb", 3))

NAMESPACES = (
    "ml-research",
    "llm-training",
    "inference-prod",
    "inference-staging",
    "data-science",
    "vision",
    "recsys",
    "notebooks",
)

# Team label of the pods of each namespace; the shared "notebooks" namespace holds several teams'.
NAMESPACE_TEAMS = {
    "ml-research": "research",
    "llm-training": "llm",
    "inference-prod": "serving",
    "inference-staging": "serving",
    "data-science": "data-science",
    "vision": "vision",
    "recsys": "recsys",
    "notebooks": "data-science",
}
NOTEBOOK_TEAMS = ("data-science", "research", "vision")
COST_CENTERS = {
    "research": "cc-1001",
    "llm": "cc-1002",
    "serving": "cc-2001",
    "data-science": "cc-3001",
    "vision": "cc-1003",
    "recsys": "cc-2002",
}
