"""The engine's settings: its windows and bounds, and the classifier's settings it passes on.

One frozen :class:`EngineConfig`; the command builds it from flags, every collaborator reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpupipe_consumers.alerts.rules.classify import DEFAULT_CONFIG, ClassifyConfig

__all__ = ["MINUTE_MS", "EngineConfig"]

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
    that GPU after it shows it healthy (see :mod:`gpupipe_consumers.alerts.engine.recovery_policy`); off: at
    once."""
    confirm_within_ms: int = 10 * MINUTE_MS
    """How long an alert waits for that sample before it says the GPU has not come back (it keeps waiting)."""
    keepalive_ms: int = 6 * 60 * MINUTE_MS
    """An open alert unchanged for this long is published again as it is: a restart restores open alerts
    from a bounded look-back of ``gpu.alerts.v1``, so every open alert must have a revision within it,
    however long ago it last changed (the command keeps it under half of ``--restore-lookback``)."""
    max_event_age_ms: int = 6 * 60 * MINUTE_MS
    """An XidEvent whose own time is older than this when processed is history, not a new fault: it feeds
    the GPU's history (recurrence rules) but opens, folds into or drains nothing. A kernel-log backlog
    read again without its cursor re-publishes every XID of the boot with its original time."""
    recurrence_horizon_ms: int = 6 * 60 * MINUTE_MS
    """An occurrence more than ``dedupe_window_ms`` after the open alert's latest one, but within this, of
    the same job (or of none known) continues that alert instead of superseding it: a job that hits the
    same fault every quarter of an hour is one incident, and superseding would notify Alertmanager again
    for each. 0 (or less than the dedupe window): every such recurrence starts a new alert."""
    max_open_alerts: int = 100_000
    """Open alerts held at most (and as many resolved ones kept for reopening). Any node's producer may
    write XIDs of any code for any GPU it names, each a new alert: at the cap an occurrence that would
    open one is refused (counted as ``capped_alert``), while open alerts go on folding, ending and
    draining, so a flood turns into a visible condition instead of an out-of-memory crash."""
    classify: ClassifyConfig = field(default=DEFAULT_CONFIG)

    def __post_init__(self) -> None:
        for name in (
            "dedupe_window_ms",
            "resolve_after_ms",
            "node_burst_window_ms",
            "confirm_within_ms",
            "keepalive_ms",
            "max_event_age_ms",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.recurrence_horizon_ms < 0:
            raise ValueError("recurrence_horizon_ms must not be negative")
        if self.update_interval_ms < 0 or self.sighting_merge_ms < 0 or self.max_future_skew_ms < 0:
            raise ValueError("intervals must not be negative")
        if self.node_burst_gpus < 2:
            raise ValueError("node_burst_gpus must be at least 2")
        if self.event_id_memory < 1 or self.max_open_alerts < 1:
            raise ValueError("event_id_memory and max_open_alerts must be positive")
