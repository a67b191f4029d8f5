"""On a real broker: with cooperative-sticky assignment a second instance joining moves
only some partitions; the first instance keeps the others without restoring or replaying them, and
the output is still exactly once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.integration.chargeback_util import (
    Progress,
    new_id,
    read_output,
    start_service,
    stop_service,
    wait_log,
    window_keys,
)
from tests.integration.consumers.chargeback.test_environments import produce, samples

pytestmark = pytest.mark.integration

COOP = ("--kafka-config", "partition.assignment.strategy=cooperative-sticky")


def restored(log: Path) -> list[int]:
    """Partitions whose state was (re)built: restored from a checkpoint or started fresh."""
    return [
        int(p) for p in re.findall(r"partition (?:restored|starts fresh) partition=(\d+)", log.read_text())
    ]


def test_a_joining_instance_moves_only_some_partitions(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    t_in = topic_prefix + topics.SAMPLES
    produce(kafka, t_in, samples("co", 12, 0, 45))
    group = f"cb-coop-{new_id()}"
    args = ("--window", "10m", "--grace", "1m", "--group-id", group, "--commit-interval", "200ms", *COOP)
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    prog = Progress(kafka, group, t_in)
    a = start_service(kafka, topic_prefix, log_a, *args, "--instance-id", "a")
    b = None
    try:
        wait_log(log_a, "partitions assigned")
        prog.wait_done(60, [a])
        first = restored(log_a)
        b = start_service(kafka, topic_prefix, log_b, *args, "--instance-id", "b")
        wait_log(log_b, "partitions assigned")
        wait_log(log_a, "partitions revoked")
        produce(kafka, t_in, samples("co", 12, 45, 90))
        prog.refresh_high()
        prog.wait_done(60, [a, b])
        assert stop_service(b) == 0, log_b.read_text()[-3000:]
        assert stop_service(a) == 0, log_a.read_text()[-3000:]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        prog.close()
    moved = restored(log_b)
    kept_by_a = set(first) - set(moved)
    assert sorted(first) == list(range(12)) and moved and kept_by_a, (first, moved)
    # A restored (hence replayed) nothing again after B joined: only what moved was restored, by B.
    assert sorted(restored(log_a)) == sorted(first)
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    keys = window_keys(out)
    assert len(keys) == len(set(keys)), "a window record was emitted twice"
    # 90 samples of 10 s per GPU: windows 0 (0-600 s) closed for every GPU, 600 s each.
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(12 * 600.0)
