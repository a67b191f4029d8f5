"""The chargeback service's settings, its own Prometheus metrics and its output key: the parts of
the service (:mod:`gpupipe_consumers.chargeback.service`) that are plain data, kept apart from its loop."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpupipe_consumers.chargeback.identity import BASE_GROUP_ID, transactional_id
from gpupipe_consumers.chargeback.sample_age import DEFAULT_MAX_SAMPLE_AGE_MS

OP_TIMEOUT_S = 30.0  # one Kafka client call of the service (transactions, offsets)


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    bootstrap: str
    input_topic: str
    output_topic: str
    deadletter_topic: str
    group_id: str = BASE_GROUP_ID
    instance_id: str = "chargeback"
    static_membership: bool = True
    commit_interval_s: float = 1.0
    commit_records: int = 100_000
    batch_size: int = 5_000
    poll_timeout_s: float = 0.2
    start: str = "earliest"  # where a partition without a checkpoint starts: earliest | latest
    transaction_timeout_ms: int = 30_000
    extra: dict[str, str] | None = None
    transactional_id_override: str | None = None
    idle_timeout_s: float | None = None  # close an idle partition's windows by broker time after this
    progress_group: str | None = None  # where true positions go for lag tooling (None: <group>.progress)
    # How far back the output topic is read for the ids of windows a partition restarted without
    # our checkpoint may emit again: the input's retention (3 days) and a day of margin.
    dedupe_lookback_s: float = 4 * 86_400.0
    # A sample further behind its Kafka timestamp is dead-lettered, not billed (sample_age.py).
    max_sample_age_ms: int = DEFAULT_MAX_SAMPLE_AGE_MS

    @property
    def transactional_id(self) -> str:
        return transactional_id(self.group_id, self.instance_id, self.transactional_id_override)


class ChargebackMetrics:
    """The service's own metrics (the engine's counters are collected at scrape time)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.consumed = Counter(
            "gpupipe_chargeback_records_consumed",
            "Input records consumed (replayed ones included).",
            registry=registry,
        )
        self.foreign_checkpoints = Counter(
            "gpupipe_chargeback_foreign_checkpoints",
            "Partitions restored from a committed offset without a chargeback checkpoint (an offset "
            "reset, a mirror failover): re-processed from there, their windows emitted again.",
            registry=registry,
        )
        self.missing_checkpoints = Counter(
            "gpupipe_chargeback_missing_checkpoints",
            "Partitions started without any committed offset while the output topic already held "
            "records (the group's offsets expired or were deleted): their retained input is "
            "re-processed and its windows emitted again.",
            registry=registry,
        )
        self.replayed = Counter(
            "gpupipe_chargeback_records_replayed",
            "Input records consumed again after a restart, rebalance or abort to rebuild open windows.",
            registry=registry,
        )
        self.emitted = Counter(
            "gpupipe_chargeback_records_emitted",
            "ChargebackWindow records committed, by kind (window, correction).",
            ["kind"],
            registry=registry,
        )
        self.transactions = Counter(
            "gpupipe_chargeback_transactions",
            "Kafka transactions, by outcome (committed, aborted).",
            ["outcome"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "gpupipe_chargeback_dead_letters",
            "Input records sent to the dead-letter topic instead of being billed, by reason (too-old: "
            "older than --max-sample-age when they reached Kafka).",
            ["reason"],
            registry=registry,
        )
        self.rebalances = Counter(
            "gpupipe_chargeback_rebalances",
            "Partition assignment changes, by kind (assign, revoke, lost).",
            ["kind"],
            registry=registry,
        )
        self.commit_seconds = Histogram(
            "gpupipe_chargeback_commit_duration_seconds",
            "Time to produce the output, send the offsets and commit one transaction.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=registry,
        )
        self.last_commit = Gauge(
            "gpupipe_chargeback_last_commit_timestamp_seconds",
            "Wall-clock time of the last committed transaction (0 until this process commits one).",
            registry=registry,
        )
        self.started = Gauge(
            "gpupipe_chargeback_start_time_seconds",
            "Wall-clock time this process started: it changes on every restart, so a crash loop (a "
            "fenced or fatally failing instance restarted again and again) shows as its changes.",
            registry=registry,
        )
        self.started.set(time.time())


def output_key(rec: Mapping[str, Any]) -> bytes:
    """``namespace/node``: spreads a large namespace over the output partitions; records
    are additive partials, so nothing relies on one namespace's records sharing a partition."""
    return f"{rec['namespace']}/{rec['node']}".encode()
