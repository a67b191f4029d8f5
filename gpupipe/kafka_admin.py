"""Broker reachability and topic creation, the only admin operations gpupipe needs.

Every command checks the broker up front so an unreachable cluster is one clear
line and a non-zero exit, not a minute of librdkafka retry noise.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from gpupipe import topics
from gpupipe.errors import BrokerUnavailableError, ConfigError

log = logging.getLogger("gpupipe.kafka")

_quiet = logging.getLogger("gpupipe.kafka.probe")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False


def client_config(bootstrap: str, extra: Mapping[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    """Base librdkafka config shared by every client; `extra` (from --kafka-config) wins."""
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": log}
    conf.update(kw)
    conf.update(extra or {})
    return conf


def parse_kafka_overrides(items: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"--kafka-config expects key=value, got {part!r}")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def parse_topic_overrides(partitions: Iterable[str], retention: Iterable[str]) -> dict[str, topics.TopicSpec]:
    """`--topic-partitions samples=24` and `--topic-retention xid=90d` into per-topic specs."""
    from gpupipe.durations import parse_positive_duration_ms

    specs = dict(topics.DEFAULT_SPECS)
    for flag, items in (("--topic-partitions", partitions), ("--topic-retention", retention)):
        for item in items:
            name, sep, value = item.partition("=")
            base = topics.resolve_alias(name.strip())
            if not sep or base is None:
                raise ConfigError(
                    f"{flag} expects NAME=VALUE with NAME one of {sorted(topics.ALIASES)}, got {item!r}"
                )
            spec = specs[base]
            if flag == "--topic-partitions":
                if not value.strip().isdigit() or int(value) < 1:
                    raise ConfigError(f"{flag} {item!r}: partitions must be a positive integer")
                specs[base] = dataclasses.replace(spec, partitions=int(value))
            else:
                specs[base] = dataclasses.replace(spec, retention_ms=parse_positive_duration_ms(value))
    return specs


def wait_for_broker(bootstrap: str, timeout_s: float = 10.0, extra: Mapping[str, str] | None = None) -> None:
    """Raise BrokerUnavailableError unless the cluster answers a metadata request in time."""
    conf = client_config(bootstrap, extra)
    conf["logger"] = _quiet
    try:
        md = AdminClient(conf).list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerUnavailableError(
            f"cannot reach Kafka at {bootstrap} within {timeout_s:g}s ({exc.args[0].str()})"
        ) from exc
    if not md.brokers:
        raise BrokerUnavailableError(f"Kafka at {bootstrap} answered with no brokers")


def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    prefix: str = "",
    specs: Mapping[str, topics.TopicSpec] | None = None,
    replication_factor: int = -1,
    extra: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create missing topics (prefixed names) with the default partitions/retention; return those created.

    `replication_factor=-1` lets the broker apply its default, which is right for
    both a one-node dev broker and a production cluster.
    """
    admin = AdminClient(client_config(bootstrap, extra))
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = []
    for base in names:
        name = topics.with_prefix(prefix, base)
        if name in existing:
            continue
        spec = (specs or topics.DEFAULT_SPECS).get(
            base, topics.TopicSpec(partitions=3, retention_ms=7 * 86_400_000)
        )
        wanted.append(
            NewTopic(
                name,
                num_partitions=spec.partitions,
                replication_factor=replication_factor,
                config={
                    "retention.ms": str(spec.retention_ms),
                    "cleanup.policy": spec.cleanup_policy,
                    **({"message.timestamp.type": spec.timestamp_type} if spec.timestamp_type else {}),
                },
            )
        )
    created = []
    for name, fut in admin.create_topics(wanted, operation_timeout=timeout_s).items() if wanted else []:
        try:
            fut.result()
            created.append(name)
            log.info("created topic", extra={"fields": {"topic": name}})
        except KafkaException as exc:
            if exc.args[0].code() != exc.args[0].TOPIC_ALREADY_EXISTS:
                raise BrokerUnavailableError(f"cannot create topic {name}: {exc.args[0].str()}") from exc
    return created
