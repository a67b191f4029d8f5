"""NVLink link health through `gpupipe alerts` as deployed: GpuSamples on Kafka whose per-link counters
rise on one link become a GpuNvLinkDegrading record on gpu.alerts.v1 and an Alertmanager alert labelled
with the link, naming the NVLink domain's GPUs and pods."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupipe.kafka import topics
from tests.integration.consumers.alerts.test_service import (
    Alertmanager,
    AlertsProcess,
    TopicReader,
    _topics,
    produce,
    sample,
    wait_until,
)

pytestmark = pytest.mark.integration

BUSES = ("0000:18:00", "0000:28:00", "0000:38:00")


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path).start()
    try:
        yield am
    finally:
        am.stop()


def link_sample(bus: str, ts: int, crc: int) -> dict[str, Any]:
    pod = f"train-{bus[5:7]}"
    return sample(
        "node-a",
        bus,
        ts,
        nvlink_links=18,
        nvlink_link_counters=[{"link": 2, "up": True, "peer": "nvswitch", "crc_flit": crc, "replay": crc}],
        allocations=[
            {"namespace": "team-a", "pod": pod, "container": "main", "resource_name": None, "replica": None}
        ],
    )


def test_a_degrading_link_reaches_kafka_and_alertmanager(
    kafka: str, topic_prefix: str, alertmanager: Alertmanager, tmp_path: Path
) -> None:
    t = _topics(kafka, topic_prefix)
    reader = TopicReader(kafka, t[topics.ALERTS])
    svc = AlertsProcess(
        kafka, topic_prefix, tmp_path, "--alertmanager-url", alertmanager.url, "--update-interval", "1s"
    ).start()
    try:
        # ten minutes of samples every 10 s, ending now: GPU 18's link 2 gains errors every minute from
        # minute 3 on; the others stay clean
        now = int(time.time() * 1000)
        start = now - 10 * 60_000
        records = []
        for k in range(61):
            ts = start + k * 10_000
            bad = max(0, (ts - start) // 60_000 - 2) * 4
            records += [link_sample(bus, ts, bad if bus == BUSES[0] else 0) for bus in BUSES]
        produce(kafka, t[topics.SAMPLES], "GpuSample", records)

        def degrading() -> list[dict[str, Any]]:
            return [r for r in reader.latest().values() if r["alertname"] == "GpuNvLinkDegrading"]

        def named_domain() -> list[dict[str, Any]]:
            # the peers' samples may be read after GPU 18's (other partitions): they join the alert then
            return [r for r in degrading() if len(r["gpus"]) == len(BUSES)]

        (rec,) = wait_until(named_domain, 20, "GpuNvLinkDegrading naming the NVLink domain on gpu.alerts.v1")
        assert (rec["signal"], rec["severity"], rec["pci_bus_id"]) == (
            "nvlink_link:2",
            "warning",
            "0000:18:00.0",
        )
        assert rec["gpus"][0] == "GPU-node-a-18"  # the link's GPU, then its domain in arrival order
        assert set(rec["gpus"]) == {"GPU-node-a-18", "GPU-node-a-28", "GPU-node-a-38"}
        assert {a["pod"] for a in rec["allocations"]} == {"train-18", "train-28", "train-38"}

        def in_am() -> list[dict[str, Any]]:
            return [a for a in alertmanager.alerts() if a["labels"]["alertname"] == "GpuNvLinkDegrading"]

        def in_am_with_pods() -> list[dict[str, Any]]:
            return [a for a in in_am() if a["annotations"].get("pods", "").count("train-") == len(BUSES)]

        (am,) = wait_until(in_am_with_pods, 15, "the alert in Alertmanager naming the domain's pods")
        assert (am["labels"]["nvlink_link"], am["labels"]["node"], am["labels"]["severity"]) == (
            "2",
            "node-a",
            "warning",
        )
        assert set(am["annotations"]["pods"].split(", ")) == {f"team-a/train-{b[5:7]}" for b in BUSES}
        assert "peer nvswitch" in am["annotations"]["description"]
    finally:
        assert svc.stop() == 0, svc.log_text()[-3000:]
        reader.close()
