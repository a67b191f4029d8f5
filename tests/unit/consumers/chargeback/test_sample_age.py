"""--max-sample-age: a sample further behind its Kafka timestamp is dead-lettered, never billed.

The pure rule (``sample_age.too_old``), the flag, and the service on the in-memory broker: too-old
samples go to the dead-letter topic once (not again on a replay), the rest is billed exactly as
without them, and a chargeback catching up on input that reached Kafka in time bills all of it
whatever its own clock says (the input here is weeks old).
"""

from __future__ import annotations

import argparse

import pytest

from gpupipe_consumers.chargeback import command
from gpupipe_consumers.chargeback.sample_age import DEFAULT_MAX_SAMPLE_AGE_MS, TOO_OLD, too_old
from gpupipe_consumers.chargeback.service_config import ServiceConfig
from tests.unit.consumers.chargeback.test_service import (
    DLQ,
    T0,
    Broker,
    expected_output,
    input_log,
    output,
    run_service,
)

DAY = 86_400_000


def test_the_bound_is_inclusive_and_measured_against_the_kafka_timestamp() -> None:
    assert too_old(T0, T0 + DAY, DAY) is None
    assert too_old(T0, T0 - 300 * DAY, DAY) is None  # a chargeback catching up: arrival is what counts
    assert too_old(T0 + 60_000, T0, DAY) is None  # ahead of broker time: --max-clock-skew's business
    detail = too_old(T0 - 300 * DAY, T0, DAY)
    assert detail is not None and "300d before its Kafka timestamp" in detail
    assert "--max-sample-age 1d" in detail
    assert too_old(T0, T0 + DAY + 1, DAY) is not None


def test_the_default_is_a_day_and_the_flag_is_bounded_by_the_contract() -> None:
    cfg = ServiceConfig(bootstrap="b", input_topic="i", output_topic="o", deadletter_topic="d")
    assert cfg.max_sample_age_ms == DAY
    assert DEFAULT_MAX_SAMPLE_AGE_MS == DAY
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    assert p.parse_args([]).max_sample_age == DAY
    assert p.parse_args(["--max-sample-age", "6h"]).max_sample_age == 6 * 3_600_000
    for bad in ("0", "-1h", "401d", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--max-sample-age", bad])


def _with_old_samples(old_every: int) -> tuple[dict, list, set[bytes]]:
    """The fake input with every ``old_every``-th record of partition 1 reaching Kafka two days
    after its time (a forged or stale sample), and what the engine should bill without them."""
    log, fed = input_log()
    old: set[bytes] = set()
    for off in range(5, len(log[1]), old_every):
        value, ts = log[1][off]
        log[1][off] = (value, ts + 2 * DAY)
        old.add(value)
    fed = [(s, p, o) for s, p, o in fed if not (p == 1 and log[1][o][0] in old)]
    return log, fed, old


def test_too_old_samples_are_dead_lettered_once_and_the_rest_billed_exactly() -> None:
    log, fed, old = _with_old_samples(old_every=40)
    full = {p: list(v) for p, v in log.items()}
    broker = Broker({p: v[: len(v) // 2] for p, v in log.items()})
    svc, _ = run_service(broker, batch_size=250, commit_records=250, commit_interval_s=0.0)
    assert svc.metrics.dead_letters.labels(TOO_OLD)._value.get() > 0
    broker.log = full  # a restart replays from the checkpoints: no dead letter twice
    run_service(broker, batch_size=250, commit_records=250, commit_interval_s=0.0)
    assert output(broker) == expected_output(fed)
    dead = [v for t, v in broker.output if t == DLQ]
    assert sorted(dead) == sorted([b"garbage", *old])


def test_a_longer_bound_bills_what_the_default_refuses() -> None:
    """How an operator re-bills a legitimate late batch: the same input under a longer bound."""
    log, _, _ = _with_old_samples(old_every=40)
    _, fed = input_log()
    broker = Broker(log)
    run_service(broker, batch_size=300, commit_records=300, commit_interval_s=0.0, max_sample_age_ms=3 * DAY)
    assert [v for t, v in broker.output if t == DLQ] == [b"garbage"]  # two days late: within three
    assert output(broker) == expected_output(fed)
