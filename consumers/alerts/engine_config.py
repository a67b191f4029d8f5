"""The alert engine's settings and state key, apart from the engine so that its mixins
(:mod:`consumers.alerts.engine_evidence`, :mod:`consumers.alerts.node_burst`) can name them
without importing the engine that imports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from consumers.alerts.classify import DEFAULT_CONFIG, ClassifyConfig

MINUTE_MS = 60_000


@dataclass(frozen=True, slots=True)
class EngineConfig:
    dedupe_window_ms: int = 10 * MINUTE_MS
    resolve_after_ms: int = 30 * MINUTE_MS
    update_interval_ms: int = 30_000
    node_burst_gpus: int = 3
    node_burst_window_ms: int = MINUTE_MS
    sighting_merge_ms: int = 2_000
    max_future_skew_ms: int = 5 * MINUTE_MS
    event_id_memory: int = 200_000
    confirm_by_samples: bool = True
    """The service reads gpu.samples.v1: a reboot or driver load ends a GPU's alert only once a sample of
    that GPU after it shows it healthy (see :mod:`consumers.alerts.recovery_policy`); off: at once."""
    confirm_within_ms: int = 10 * MINUTE_MS
    """How long an alert waits for that sample before it says the GPU has not come back (it keeps waiting)."""
    classify: ClassifyConfig = field(default=DEFAULT_CONFIG)

    def __post_init__(self) -> None:
        for name in ("dedupe_window_ms", "resolve_after_ms", "node_burst_window_ms", "confirm_within_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.update_interval_ms < 0 or self.sighting_merge_ms < 0 or self.max_future_skew_ms < 0:
            raise ValueError("intervals must not be negative")
        if self.node_burst_gpus < 2:
            raise ValueError("node_burst_gpus must be at least 2")
        if self.event_id_memory < 1:
            raise ValueError("event_id_memory must be positive")


Key = tuple[str, str, str, str]
