"""On a real broker: a rolling update of a price change bills every window at one price.

Mid-update, instance ``a`` runs the new price file (H200 4.0 -> 8.0 from V) and ``b`` still the old
one, each with half of the partitions. Input crosses V. Neither may emit a window from V on while
the other prices it differently: they read each other's checkpoints (the fingerprint of their price
schedules), wait there with their partitions paused, and go on when ``b`` is replaced by an
instance with the new file. Every window then has one price, and nothing is lost or doubled.
"""

from __future__ import annotations

import time
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
    window_keys,
)
from tests.integration.consumers.chargeback.test_environments import T0, produce, samples

pytestmark = pytest.mark.integration

W = 300_000
V = T0 + 6 * W  # the price change, 30 minutes into the input (T0 is a whole hour)
TICK = 10_000
PRICES = "currency: USD\nenergy_per_kwh: 0.1\nmodels: [{match: NVIDIA H200, per_gpu_hour: 4.0}]\n"


def test_a_rolling_update_never_bills_a_window_at_two_prices(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(PRICES)
    change = f"{{valid_from: '{format_iso_ms(V)}', models: [{{match: NVIDIA H200, per_gpu_hour: 8.0}}]}}"
    new.write_text(f"{PRICES}changes: [{change}]\n")
    split = (V - W - T0) // TICK  # input before the update ends one window before V
    end = (V + 4 * W - T0) // TICK
    produce(kafka, t_in, samples("ml", 6, 0, split))
    group = f"cb-prices-{new_id()}"
    args = ("--window", "5m", "--grace", "30s", "--group-id", group, "--commit-interval", "200ms")
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "b2")}
    prog = Progress(kafka, group, t_in)
    procs = {
        "a": start_service(kafka, topic_prefix, logs["a"], *args, "--instance-id", "a", "--prices", str(new)),
        "b": start_service(kafka, topic_prefix, logs["b"], *args, "--instance-id", "b", "--prices", str(old)),
    }
    try:
        for name in ("a", "b"):  # each learns the other's prices from its checkpoints
            wait_log(logs[name], "another instance prices differently")
        produce(kafka, t_in, samples("ml", 6, split, end))
        for name in ("a", "b"):  # both reach V's window end: they wait
            wait_log(logs[name], "holding partitions until the instances agree on prices")
        assert all(r["window_start_ms"] < V for r in read_output(kafka, topic_prefix + topics.CHARGEBACK))
        assert stop_service(procs.pop("b")) == 0, logs["b"].read_text()[-3000:]
        procs["b2"] = start_service(
            kafka, topic_prefix, logs["b2"], *args, "--instance-id", "b", "--prices", str(new)
        )
        prog.refresh_high()
        prog.wait_done(60, procs.values())
        wait_log(logs["a"], "every instance prices alike again")
        for name in list(procs):
            assert stop_service(procs.pop(name)) == 0, logs[name].read_text()[-3000:]
    finally:
        kill_left(procs)
        prog.close()
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert_billed_once_at_one_price(out)
    # 6 GPUs, 10 s per sample; the windows that closed are those ending 30 s before the last sample.
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(6 * 9 * 300.0)
    assert sum(r["cost_allocation"] for r in out) == pytest.approx(6 * (6 * 300 * 4.0 + 3 * 300 * 8.0) / 3600)
    assert time.time() * 1000 > V + 4 * W  # the input was in the past (broker time bounds it)


def assert_billed_once_at_one_price(out: list[dict]) -> None:
    """Every window once, each at one price: the old one before V, the new one from V on."""
    keys = window_keys(out)
    assert len(keys) == len(set(keys)), "a window record was emitted twice"
    prices: dict[int, set[float]] = {}
    for r in out:
        prices.setdefault(r["window_start_ms"], set()).add(r["price_per_gpu_hour"])
    assert all(len(p) == 1 for p in prices.values()), prices
    assert {w: p.pop() for w, p in prices.items()} == {
        T0 + k * W: (4.0 if T0 + k * W < V else 8.0) for k in range(9)
    }
