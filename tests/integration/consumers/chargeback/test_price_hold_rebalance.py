"""A group rebalance while partitions are held for the price agreement on a real broker.

librdkafka keeps an application ``pause()`` across unassign/assign. Instance ``a`` (new price
file) holds its partitions at the change while ``b`` (old file) runs. ``b`` is a dynamic member (no
static membership), so when it leaves, the group rebalances at once and ``a`` gets every partition,
including the ones it had paused (``a`` is static: its member id sorts first, so the round-robin
assignor gives it the same partitions in every rebalance). ``b`` comes back with the new file (the
rolling update completes). The service used to forget its holds on assignment without resuming
them: those partitions stayed paused, their windows were never billed and nothing said so. Every
partition must be read to its end and billed exactly, at one price.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupipe.common.durations import format_iso_ms
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.integration.chargeback_util import (
    Progress,
    kill_left,
    new_id,
    read_output,
    start_service,
    stop_service,
    wait_log,
)
from tests.integration.consumers.chargeback.test_environments import T0, produce, samples
from tests.integration.consumers.chargeback.test_price_rollout import (
    PRICES,
    TICK,
    V,
    W,
    assert_billed_once_at_one_price,
)

pytestmark = pytest.mark.integration


def test_partitions_held_through_a_rebalance_are_read_again(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(PRICES)
    change = f"{{valid_from: '{format_iso_ms(V)}', models: [{{match: NVIDIA H200, per_gpu_hour: 8.0}}]}}"
    new.write_text(f"{PRICES}changes: [{change}]\n")
    split = (V - W - T0) // TICK
    end = (V + 4 * W - T0) // TICK
    produce(kafka, t_in, samples("ml", 6, 0, split))
    group = f"cb-hold-rebalance-{new_id()}"
    args = ("--window", "5m", "--grace", "30s", "--group-id", group, "--commit-interval", "200ms")
    dynamic = "--no-static-membership"  # a member that leaves makes the group rebalance at once
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "b2")}
    prog = Progress(kafka, group, t_in)
    procs = {
        "a": start_service(kafka, topic_prefix, logs["a"], *args, "--instance-id", "a", "--prices", str(new)),
        "b": start_service(
            kafka, topic_prefix, logs["b"], *args, dynamic, "--instance-id", "b", "--prices", str(old)
        ),
    }
    try:
        wait_log(logs["a"], "another instance prices differently")
        # b too must have read a's table before the input crosses V: an instance that has not read
        # it yet bills on at its own price (a race the agreement cannot close; a is then
        # refused when it takes those partitions over, as
        # tests/unit/consumers/chargeback/test_price_takeover.py shows)
        wait_log(logs["b"], "another instance prices differently")
        produce(kafka, t_in, samples("ml", 6, split, end))
        wait_log(logs["a"], "holding partitions until the instances agree on prices")
        assigned_before = logs["a"].read_text().count("partitions assigned")
        assert stop_service(procs.pop("b")) == 0, logs["b"].read_text()[-3000:]
        # b left the group: a rebalance hands a every partition, its held ones among them
        wait_log(logs["a"], "partitions assigned", count=assigned_before + 1)
        procs["b2"] = start_service(
            kafka, topic_prefix, logs["b2"], *args, dynamic, "--instance-id", "b", "--prices", str(new)
        )
        prog.refresh_high()
        prog.wait_done(60, procs.values())  # every partition read to its end (none left paused)
        for name in list(procs):
            assert stop_service(procs.pop(name)) == 0, logs[name].read_text()[-3000:]
    finally:
        kill_left(procs)
        prog.close()
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert_billed_once_at_one_price(out)
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(6 * 9 * 300.0)
