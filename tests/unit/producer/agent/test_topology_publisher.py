"""The topology is handed over at the first tick, again only when it changed, after Kafka is ready,
and again when it was not delivered in time."""

from __future__ import annotations

from typing import Any

from gpupipe_producer.agent.topology_publisher import TopologyPublisher
from gpupipe_producer.nvml.source import NvmlSource
from gpupipe_schemas.codec import AvroCodec
from tests.fake_nvml import FakeClock, FakeNvml


class _Kafka:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []
        self.delivered = 0
        self.ready = True


def _setup(count: int = 4) -> tuple[FakeNvml, NvmlSource, _Kafka, TopologyPublisher, FakeClock]:
    nvml = FakeNvml.node("H100", count)
    src = NvmlSource(nvml, "node-1", sysfs_pci="/nonexistent")
    src.start()
    kafka, clock = _Kafka(), FakeClock()
    pub = TopologyPublisher(
        "node-1",
        "gpu.topology.v1",
        AvroCodec().encoder("GpuTopology").encode,
        lambda t, k, v: kafka.records.append((t, k, v)),
        lambda t: kafka.delivered,
        ready=lambda: kafka.ready,
        clock=clock,
    )
    return nvml, src, kafka, pub, clock


def _decoded(value: bytes) -> dict[str, Any]:
    return AvroCodec().decode(value).record


def test_once_per_change_and_only_when_ready() -> None:
    nvml, src, kafka, pub, _ = _setup()
    kafka.ready = False
    pub.tick(src, nvml)
    assert pub.reads == 1 and kafka.records == []  # read, held until the topics exist
    kafka.ready = True
    for _ in range(5):
        pub.tick(src, nvml)
        kafka.delivered = len(kafka.records)
    assert pub.reads == 1 and len(kafka.records) == 1
    topic, key, value = kafka.records[0]
    assert (topic, key) == ("gpu.topology.v1", b"node-1") and len(_decoded(value)["gpus"]) == 4

    nvml.gpus[2].lose()
    src.poll()  # the source marks it lost: the GPU set changed
    pub.tick(src, nvml)
    assert pub.reads == 2 and len(kafka.records) == 2
    assert [g["gpu_lost"] for g in _decoded(kafka.records[1][2])["gpus"]] == [False, False, True, False]


def test_the_same_topology_read_again_is_not_handed_over() -> None:
    nvml, src, kafka, pub, _ = _setup()
    pub.tick(src, nvml)
    kafka.delivered = 1
    pub._gpu_set = None  # as after a GPU set change that ends where it began
    pub.tick(src, nvml)
    assert pub.reads == 2 and len(kafka.records) == 1


def test_an_undelivered_topology_is_handed_over_again() -> None:
    nvml, src, kafka, pub, clock = _setup()
    pub.tick(src, nvml)
    clock.advance(60)
    pub.tick(src, nvml)
    assert len(kafka.records) == 1  # librdkafka is still trying
    clock.advance(400)
    pub.tick(src, nvml)
    assert len(kafka.records) == 2
    kafka.delivered = 1
    clock.advance(400)
    pub.tick(src, nvml)
    assert len(kafka.records) == 2
