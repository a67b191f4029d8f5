"""The chargeback service's Kafka identities, and the client overrides it cannot honour.

Two environments on one cluster (``--topic-prefix staging.`` next to production) must never share
a consumer group, a ``group.instance.id`` namespace or a ``transactional.id``: with shared ids the
later process fences the earlier one and takes its partitions, and billing stops without an
error. So every identity derives from the topic prefix unless it is given explicitly.

The loop assigns partitions itself inside the rebalance callbacks: eagerly by default (every
rebalance revokes, commits and restores everything), or incrementally with
``partition.assignment.strategy=cooperative-sticky`` (only moved partitions are restored and
replayed). Other assignors, and the KIP-848 ``group.protocol=consumer`` (whose
callbacks the loop does not handle), are refused at start instead of failing mid-run.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpupipe.common.errors import ConfigError
from gpupipe.kafka.acls import DEFAULT_GROUPS

BASE_GROUP_ID = DEFAULT_GROUPS["chargeback"]


def default_group_id(prefix: str) -> str:
    """``<prefix>gpupipe-chargeback``: each environment gets a group of its own."""
    return f"{prefix}{BASE_GROUP_ID}" if prefix else BASE_GROUP_ID


def transactional_id(group_id: str, instance_id: str, override: str | None = None) -> str:
    """``<group id>.<instance id>`` (the group carries the prefix), unless overridden."""
    return override or f"{group_id}.{instance_id}"


def check_client_overrides(extra: Mapping[str, str] | None) -> None:
    """Refuse ``--kafka-config`` settings that break the eager assign/revoke protocol."""
    extra = extra or {}
    strategy = extra.get("partition.assignment.strategy", "").strip().lower()
    if strategy and strategy not in ("roundrobin", "range", "cooperative-sticky"):
        raise ConfigError(
            f"partition.assignment.strategy={strategy} is not supported by chargeback: use "
            "cooperative-sticky (incremental: only moved partitions replay), roundrobin or range"
        )
    protocol = extra.get("group.protocol", "classic").strip().lower()
    if protocol != "classic":
        raise ConfigError(
            f"group.protocol={protocol} is not supported by chargeback (incremental assignment); "
            "use the classic group protocol"
        )
    for key in ("group.id", "group.instance.id", "transactional.id"):
        if key in extra:
            raise ConfigError(
                f"--kafka-config {key}=... is not allowed: use --group-id, --instance-id or "
                "--transactional-id so the identities stay consistent with each other"
            )
