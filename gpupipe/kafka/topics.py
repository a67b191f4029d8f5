"""Topic names (with an optional environment prefix) and their defaults.

The topics are a public interface for data-platform jobs, so names carry the
schema major version (`.v1`); a breaking change would get a new topic, never an
incompatible record on the old one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SAMPLES = "gpu.samples.v1"
XID = "gpu.xid.v1"
CHARGEBACK = "gpu.chargeback.v1"
ALERTS = "gpu.alerts.v1"
DEADLETTER = "gpu.deadletter.v1"
RECOMMENDATIONS = "gpu.recommendations.v1"
TOPOLOGY = "gpu.topology.v1"

ALL = (SAMPLES, XID, CHARGEBACK, ALERTS, DEADLETTER, RECOMMENDATIONS, TOPOLOGY)

# Record types a topic carries; `tail` and the dead-letter logic use it.
RECORDS_ON = {
    SAMPLES: ("GpuSample",),
    XID: ("XidEvent",),
    CHARGEBACK: ("ChargebackWindow",),
    ALERTS: ("GpuAlert",),
    RECOMMENDATIONS: ("GpuRecommendation",),
    TOPOLOGY: ("GpuTopology",),
}


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """Creation defaults: sized for a 10k-GPU cluster at 1 sample/s (~10k msg/s on samples)."""

    partitions: int
    retention_ms: int
    cleanup_policy: str = "delete"
    timestamp_type: str | None = None
    """``message.timestamp.type`` at creation (None: the broker's default, CreateTime)."""


DEFAULT_SPECS = {
    # LogAppendTime: the broker stamps each sample, so chargeback can bound a node clock that runs
    # ahead by broker time (a sample is never newer than its append); with CreateTime the bound
    # would come from the same skewed node clock.
    SAMPLES: TopicSpec(partitions=12, retention_ms=3 * 86_400_000, timestamp_type="LogAppendTime"),
    XID: TopicSpec(partitions=3, retention_ms=30 * 86_400_000),
    CHARGEBACK: TopicSpec(partitions=3, retention_ms=400 * 86_400_000),
    ALERTS: TopicSpec(partitions=3, retention_ms=30 * 86_400_000),
    DEADLETTER: TopicSpec(partitions=1, retention_ms=14 * 86_400_000),
    RECOMMENDATIONS: TopicSpec(partitions=3, retention_ms=30 * 86_400_000),
    # Compacted: the latest record per node is its topology, kept for as long as the key lives
    # (retention.ms does not apply to a compacted log; -1 says so to whoever reads the config).
    TOPOLOGY: TopicSpec(partitions=3, retention_ms=-1, cleanup_policy="compact"),
}


ALIASES = {
    "samples": SAMPLES,
    "xid": XID,
    "chargeback": CHARGEBACK,
    "alerts": ALERTS,
    "deadletter": DEADLETTER,
    "recommendations": RECOMMENDATIONS,
    "topology": TOPOLOGY,
}


def resolve_alias(name: str) -> str | None:
    """'samples' or 'gpu.samples.v1' -> 'gpu.samples.v1'; None for names that are not ours."""
    if name in ALL:
        return name
    return ALIASES.get(name)


def with_prefix(prefix: str, base: str) -> str:
    return f"{prefix}{base}" if prefix else base


def base_name(prefix: str, topic: str) -> str:
    """Undo the prefix: 'staging.gpu.xid.v1' -> 'gpu.xid.v1'."""
    return topic[len(prefix) :] if prefix and topic.startswith(prefix) else topic


def to_prepare(uses: Sequence[str], *, create: bool) -> Sequence[str]:
    """The topics a service makes sure of before it starts (base names).

    Creating, it creates every topic of the pipeline, so that whichever service a fresh cluster
    starts first, none waits for another to create its topics; not creating, it waits only for those
    it uses."""
    return ALL if create else tuple(uses)
