"""``gpupipe alerts --ack ALERT_ID``: an operator's acknowledgement that a fault was dealt with.

Faults that need a reset, reboot or RMA stay firing until evidence of recovery (see
:mod:`gpupipe_consumers.alerts.engine.facade`); when the samples cannot show it (no NVML on the node, a GPU
replaced),
a person says so. The ack is a ``GpuAlert`` record with status ``action`` and remediation kind ``ack`` on
``gpu.alerts.v1``, keyed by the alert's id: the running service (which reads acks from that topic) resolves
the alert with reason ``acknowledged``; a service that is down, or its standby, finds it when it restores.
The topic is the one durable channel every instance already reads, so no extra API or port is needed.
"""

from __future__ import annotations

import argparse
import getpass
import time
from typing import Any

from gpupipe.common.errors import ConfigError
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides, wait_for_broker
from gpupipe_consumers.alerts.engine.alert_record import action_record
from gpupipe_consumers.alerts.handler import kafka_alert_sink, restore_from_topic
from gpupipe_schemas.codec import AvroCodec, codec_from_url

__all__ = ["ack_record", "acknowledge", "find_latest", "publish_ack"]


def find_latest(records: list[dict[str, Any]], alert_id: str) -> dict[str, Any] | None:
    """The latest firing/resolved revision of ``alert_id`` among ``records`` (oldest first)."""
    latest = None
    for rec in records:
        if rec.get("alert_id") != alert_id or rec.get("status") not in ("firing", "resolved"):
            continue
        if latest is None or rec["sequence"] >= latest["sequence"]:
            latest = rec
    return latest


def ack_record(latest: dict[str, Any], note: str, who: str, now_ms: int) -> dict[str, Any]:
    """The ack record for an alert whose latest revision is ``latest``."""
    rec = action_record(
        latest,
        outcome="acknowledged",
        node=latest["hostname"],
        dry_run=False,
        detail=note[:500],
        at_ms=now_ms,
        kind="ack",
    )
    rec["instance"] = f"ack/{who}"
    return rec


def publish_ack(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    alert_id: str,
    note: str,
    lookback_ms: int,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Find the alert on ``topic`` and publish its ack; :class:`ConfigError` when there is nothing to ack."""
    latest = find_latest(restore_from_topic(bootstrap, topic, codec, lookback_ms, extra), alert_id)
    if latest is None:
        raise ConfigError(
            f"no alert {alert_id} on {topic} in the last {lookback_ms // 3_600_000}h "
            "(see --restore-lookback; the id is the alert_id field / annotation)"
        )
    if latest["status"] != "firing":
        raise ConfigError(f"alert {alert_id} is already resolved ({latest.get('resolve_reason')})")
    rec = ack_record(latest, note, getpass.getuser(), int(time.time() * 1000))
    sink = kafka_alert_sink(bootstrap, topic, codec, extra)
    sink.send(rec)
    sink.flush(30.0)
    return rec


def acknowledge(args: argparse.Namespace) -> int:
    """``gpupipe alerts --ack ALERT_ID``: publish the ack and say what it acknowledged."""
    extra = parse_kafka_overrides(args.kafka_config)
    wait_for_broker(args.bootstrap_servers, extra=extra)
    topic = topics.with_prefix(args.topic_prefix, topics.ALERTS)
    codec = codec_from_url(args.schema_registry_url)
    rec = publish_ack(
        args.bootstrap_servers,
        topic,
        codec,
        args.ack,
        args.ack_note,
        args.restore_lookback or 86_400_000,
        extra,
    )
    print(f"acknowledged {rec['alert_id']} ({rec['alertname']} on {rec['hostname']}) on {topic}")
    return 0
