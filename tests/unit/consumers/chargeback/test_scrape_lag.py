"""A chargeback scrape never calls into the Kafka consumer (found by the web-config test on a loaded
machine: /metrics took 3-56 s, past Prometheus' 10 s scrape timeout, because the scrape thread's
get_watermark_offsets waited for the loop thread's own consumer calls). The loop computes the lag
with its snapshot; the scrape reads the snapshot."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from gpupipe_consumers.chargeback.partitions import InputPartitions
from gpupipe_consumers.chargeback.state_metrics import PartitionInfo


class Consumer:
    def __init__(self) -> None:
        self.busy = threading.Event()  # set: a call from another thread would wait (the loop is in it)
        self.released = threading.Event()

    def get_watermark_offsets(self, tp: Any, timeout: float, cached: bool) -> tuple[int, int]:
        if self.busy.is_set():
            self.released.wait(30)
        return 0, 100


def partition_info() -> PartitionInfo:
    partitions = InputPartitions("gpu.samples.v1", "earliest", cooperative=False)
    partitions.attach(Consumer())
    partitions.assigned, partitions.positions = {0, 1}, {0: 60, 1: 100}
    engine = SimpleNamespace(replay_until=lambda p: None, watermark=lambda p: 0, stats={})
    return PartitionInfo(partitions, engine)


def test_the_scrape_reads_the_loops_lag_without_touching_the_consumer() -> None:
    info = partition_info()
    consumer = info.partitions.consumer
    info.refresh()  # the loop thread, at a commit attempt
    consumer.busy.set()  # the loop is inside consume() from now on
    got: dict = {}
    scrape = threading.Thread(target=lambda: got.update(info.snapshot()))
    scrape.start()
    scrape.join(2.0)
    alive = scrape.is_alive()
    consumer.released.set()
    scrape.join(5.0)
    assert not alive, "the scrape waited for the consumer"
    assert {p: v["lag"] for p, v in got.items()} == {0: 40, 1: 0}
