"""Names of NVIDIA GPU Operational Event values (preview, drivers R615/R620), shared by producer and alerts.

Pure data. Sources: NVIDIA, "GPU Operational Event Catalog", R620 edition
(docs.nvidia.com/deploy/gpu-operational-events/620/event-catalog.html: the category registry, "A consumer
can act on the category alone when it does not recognize a specific module event code"); "Release Notes"
(.../latest/release-notes.html: GPU-BUS 0x0003 is Xid 79, GPU-RAS SPARING_EVENT 0x003D reports Xid 185);
nvidia-ml-py 13.615.71 ``pynvml.py`` (severity and log-level constants). The catalog's POWER_ERROR and
thermal categories are listed without values here: their numbers were not read from the page.
NVIDIA states that these identifiers may change per driver release: read them with the record's
``driver_version``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATEGORIES", "KNOWN_EVENTS", "LOG_LEVELS", "SEVERITIES", "KnownEvent", "category_name"]

#: The shared category registry (value -> name), as far as its values were read.
CATEGORIES: dict[int, str] = {
    0x0001: "TIMEOUT",
    0x0002: "MEMORY_INTEGRITY_ERROR",
    0x0003: "INTERCONNECT_ERROR",
    0x0004: "CORRUPTION_DETECTED",
    0x0005: "SECURITY_ERROR",
}

#: nvmlOperationalEventSeverity_t (pynvml ``NVML_OPERATIONAL_EVENT_SEVERITY_*``).
SEVERITIES: dict[int, str] = {10: "INFORMATIONAL", 20: "CORRECTED", 30: "RECOVERABLE", 40: "FATAL"}

#: nvmlGpuOperationalEventLogLevel_t (pynvml ``NVML_GPU_OPERATIONAL_EVENT_LOG_LEVEL_*``).
LOG_LEVELS: dict[int, str] = {10: "TELEMETRY", 20: "DIAG", 30: "NOTICE", 40: "WARNING", 50: "ERROR"}


@dataclass(frozen=True, slots=True)
class KnownEvent:
    """One catalog event whose identity was read: its name (or NVIDIA's words) and its legacy Xid."""

    module: str
    code: int
    name: str
    legacy_xid: int | None
    source: str


#: (module signature, module event code) -> what NVIDIA documents of it.
KNOWN_EVENTS: dict[tuple[str, int], KnownEvent] = {
    ("GPU-BUS", 0x0003): KnownEvent(
        "GPU-BUS", 0x0003, "GPU fallen off the bus", 79, "GOE release notes R620 (New Event Coverage)"
    ),
    ("GPU-RAS", 0x003D): KnownEvent(
        "GPU-RAS", 0x003D, "SPARING_EVENT", 185, "GOE release notes R620 (New Event Coverage)"
    ),
}


def category_name(value: int) -> str | None:
    """The category's name, or None for a value this release does not know."""
    return CATEGORIES.get(int(value))
