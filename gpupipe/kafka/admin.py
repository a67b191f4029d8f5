"""Broker reachability and topic creation, the only admin operations gpupipe needs.

Every command checks the broker up front so an unreachable cluster is one clear
line and a non-zero exit, not a minute of librdkafka retry noise.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from gpupipe.common.errors import BrokerUnavailableError, ConfigError
from gpupipe.kafka import acls, topics
from gpupipe.kafka import replication as topic_replication
from gpupipe.kafka.auth import (
    KafkaAuthError,
    check_access,
    classify_client_error,
    is_secured,
    needs_for,
    principal_of,
)
from gpupipe.kafka.config import KafkaSettings, split_items

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


def parse_kafka_overrides(items: Iterable[str] | Mapping[str, str]) -> dict[str, str]:
    """`--kafka-config` items as a dict; the CLI hands over the already merged settings (a Mapping).

    See gpupipe.kafka.config for where settings come from and why secrets never come from argv.
    """
    if isinstance(items, Mapping):
        return KafkaSettings(items)
    return KafkaSettings(split_items(items, "--kafka-config"))


def parse_topic_overrides(partitions: Iterable[str], retention: Iterable[str]) -> dict[str, topics.TopicSpec]:
    """`--topic-partitions samples=24` and `--topic-retention xid=90d` into per-topic specs."""
    from gpupipe.common.durations import parse_positive_duration_ms

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
    """Raise BrokerUnavailableError unless the cluster answers a metadata request in time.

    A wrong password or an untrusted broker certificate fails at the first attempt with one line
    (KafkaAuthError) instead of retrying into a generic transport error.
    """
    conf = client_config(bootstrap, extra)
    conf["logger"] = _quiet
    errors: list[KafkaError] = []
    conf["error_cb"] = errors.append
    where = str(conf["bootstrap.servers"])
    principal = principal_of(conf)
    try:
        admin = AdminClient(conf)
    except KafkaException as exc:  # a client setting librdkafka rejects: waiting will not help
        raise ConfigError(f"Kafka refused: {exc.args[0].str()} (check --kafka-config)") from exc
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            md = admin.list_topics(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            break
        except KafkaException as exc:
            last = exc.args[0].str()
        admin.poll(0)
        for err in errors:
            line = classify_client_error(err.name(), err.str(), where, principal)
            if line:
                raise KafkaAuthError(line)
        if time.monotonic() >= deadline:
            raise BrokerUnavailableError(f"cannot reach Kafka at {where} within {timeout_s:g}s ({last})")
    if not md.brokers:
        raise BrokerUnavailableError(f"Kafka at {where} answered with no brokers")


def preflight(args: Any, words: tuple[str, ...]) -> None:
    """On a secured cluster, check at start that this command's role has its ACLs (gpupipe.kafka.acls).

    Skipped on PLAINTEXT (no authorizer to ask). Retries up to --kafka-authz-wait for ACLs that
    are still being applied, then fails with one line naming principal, resource and operation.
    """
    role = acls.COMMAND_ROLES.get(words)
    conf = client_config(args.bootstrap_servers, args.kafka_config)
    if role is None or not is_secured(conf):
        return
    try:
        wait_for_broker(args.bootstrap_servers, extra=args.kafka_config)
    except BrokerUnavailableError:
        return  # unreachable is the command's call (a node agent starts anyway and spools XIDs)
    wait_s = getattr(args, "kafka_authz_wait", 10_000) / 1000.0
    only = None
    if role == "tail":
        base = topics.resolve_alias(args.topic)
        only = topics.with_prefix(args.topic_prefix, base) if base else args.topic
    needs = needs_for(role, args.topic_prefix, getattr(args, "group_id", None), only_topic=only)
    conf["logger"] = _quiet
    check_access(AdminClient, conf, role, needs, wait_s)


def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    prefix: str = "",
    specs: Mapping[str, topics.TopicSpec] | None = None,
    replication: topic_replication.Replication | None = None,
    extra: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create missing topics (prefixed names) with the default partitions/retention; return those created.

    Replication factor and min.insync.replicas: `replication`, else gpupipe.kafka.replication's
    choice for the brokers the cluster has alive now.
    """
    admin_conf = client_config(bootstrap, extra)
    admin = AdminClient(admin_conf)
    md = admin.list_topics(timeout=timeout_s)
    existing = set(md.topics)
    copies = topic_replication.for_cluster(len(md.brokers), replication)
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
                replication_factor=copies.factor,
                config={
                    "min.insync.replicas": str(copies.min_insync),
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
            code = exc.args[0].code()
            if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED):
                raise KafkaAuthError(
                    f"Kafka denied {principal_of(admin_conf)} CREATE on topic {name}: create the topics "
                    "with the admin role (gpupipe acls --role admin) and run with --no-create-topics"
                ) from exc
            if code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise BrokerUnavailableError(f"cannot create topic {name}: {exc.args[0].str()}") from exc
    return created
