"""NVLink link health from GpuSamples to the alert: a degrading link raises GpuNvLinkDegrading
(warning) naming the link, its peer, the GPUs of its NVLink domain and their pods; it escalates to
critical when the link fails, clears after clean windows, and a record survives the schema and
Alertmanager's shape."""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.alerts.am_shape import am_annotations, am_labels
from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import HealthTracker
from gpupipe_schemas.codec import AvroCodec

T0 = 1_800_000_000_000
STEP = 10_000
HOST = "node-a"


def gpu_sample(i: int, ts: int, links: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {
        "timestamp_ms": ts,
        "hostname": HOST,
        "gpu_index": i,
        "uuid": f"GPU-{i}",
        "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
        "mig": None,
        "allocations": [{"namespace": "train", "pod": f"job-{i}", "container": "main"}],
        "gpu_lost": False,
        "nvlink_links": 18 if links else None,
        "fabric_clique_id": None,
        "nvlink_link_counters": links,
        **kw,
    }


class Node:
    """Four GPUs on NVSwitches (GPU 3 without NVLink), their samples fed to tracker and engine."""

    def __init__(self) -> None:
        self.health = HealthTracker()
        self.engine = EngineFacade(EngineConfig())
        self.ts = T0
        self.crc = 0
        self.up = True

    def tick(self) -> None:
        self.ts += STEP
        for i in range(4):
            links = (
                [] if i == 3 else [{"link": 5, "up": True, "peer": "nvswitch", "crc_flit": 0, "replay": 0}]
            )
            if i == 0:
                links[0].update(up=self.up, crc_flit=self.crc, replay=self.crc)
            ident, sigs = self.health.observe(gpu_sample(i, self.ts, links))
            assert ident is not None
            for sig in sigs:
                self.engine.on_signal(sig.subject or ident, sig, self.ts)

    def minutes(self, n: int, crc_per_minute: int = 0) -> None:
        for _ in range(n):
            self.crc += crc_per_minute
            for _ in range(6):
                self.tick()

    def records(self) -> list[dict[str, Any]]:
        self.engine.tick(self.ts)
        return [to_record(a, self.ts) for a in self.engine.take(self.ts, force=True)]


def test_a_degrading_link_warns_with_its_blast_radius_then_fails_then_clears() -> None:
    node = Node()
    node.minutes(10)
    node.minutes(2, crc_per_minute=1)
    assert node.records() == []
    node.minutes(3, crc_per_minute=3)
    (rec,) = node.records()
    assert (rec["alertname"], rec["severity"], rec["signal"], rec["cause_class"]) == (
        "GpuNvLinkDegrading",
        "warning",
        "nvlink_link:5",
        "nvlink_fabric",
    )
    assert rec["gpu_uuid"] == "GPU-0" and rec["gpus"] == ["GPU-0", "GPU-1", "GPU-2"]
    assert [a["pod"] for a in rec["allocations"]] == ["job-0", "job-1", "job-2"]
    assert "NVLink link 5 (peer nvswitch) degrading" in rec["description"]
    labels, notes = am_labels(rec), am_annotations(rec)
    assert (labels["alertname"], labels["nvlink_link"], labels["node"], labels["severity"]) == (
        "GpuNvLinkDegrading",
        "5",
        HOST,
        "warning",
    )
    assert notes["gpus"] == "GPU-0, GPU-1, GPU-2" and notes["pods"] == "train/job-0, train/job-1, train/job-2"
    codec = AvroCodec()
    assert codec.decode(codec.encoder("GpuAlert").encode(rec)).record["signal"] == "nvlink_link:5"

    node.minutes(1, crc_per_minute=100 * 60)  # DCGM's FAIL: 100 CRC errors a second
    (rec,) = node.records()
    assert (rec["severity"], rec["action"], rec["status"]) == ("critical", "WORKFLOW_NVLINK_ERR", "firing")

    node.minutes(30)  # stays open while the samples say so, clears after clean windows
    (rec,) = node.records()
    assert (rec["status"], rec["resolve_reason"]) == ("resolved", "cleared")


def test_a_link_peered_to_one_gpu_names_that_gpu_only() -> None:
    t = HealthTracker()
    peer_bus = "00000000:19:00.0"
    out = []
    for k in range(60):
        ts = T0 + k * STEP
        t.observe(gpu_sample(1, ts, [{"link": 0, "up": True, "peer": "00000000:18:00.0", "crc_flit": 0}]))
        t.observe(gpu_sample(2, ts, [{"link": 0, "up": True, "peer": "nvswitch", "crc_flit": 0}]))
        out += t.observe(gpu_sample(0, ts, [{"link": 0, "up": True, "peer": peer_bus, "crc_flit": k}]))[1]
    active = [s for s in out if s.kind == "active"]
    assert active and {g.uuid for g in active[-1].related} == {"GPU-1"}


def test_a_restored_open_link_alert_clears_only_after_clean_windows() -> None:
    t = HealthTracker()
    t.await_clear(HOST, "0000:18:00.0", "nvlink_link:5")
    kinds = []
    for k in range(6 * 20):
        s = gpu_sample(0, T0 + k * STEP, [{"link": 5, "up": True, "peer": "nvswitch", "crc_flit": 0}])
        kinds += [(k // 6, e.kind) for e in t.observe(s)[1]]
    assert kinds[0] == (0, "active") and kinds[-1][1] == "clear" and kinds[-1][0] >= 15


def test_a_gpu_whose_samples_come_after_the_warning_joins_its_blast_radius_once() -> None:
    # partitions are read in any order: GPU 0's whole history may be handled before GPU 1's first sample
    t = HealthTracker()
    engine = EngineFacade(EngineConfig())
    ts = T0
    for k in range(60):
        ts = T0 + k * STEP
        ident, sigs = t.observe(
            gpu_sample(0, ts, [{"link": 1, "up": True, "peer": "nvswitch", "crc_flit": k}])
        )
        for sig in sigs:
            engine.on_signal(sig.subject or ident, sig, ts)
    (rec,) = [to_record(a, ts) for a in engine.open_alerts()]
    assert rec["gpus"] == ["GPU-0"]
    joined = []
    for _ in range(3):
        ts += STEP
        ident, sigs = t.observe(
            gpu_sample(1, ts, [{"link": 1, "up": True, "peer": "nvswitch", "crc_flit": 0}])
        )
        joined += sigs
        for sig in sigs:
            engine.on_signal(sig.subject or ident, sig, ts)
    (sig,) = joined  # named once, for GPU 0's link
    assert sig.subject is not None and sig.subject.uuid == "GPU-0" and sig.signal == "nvlink_link:1"
    (rec,) = [to_record(a, ts) for a in engine.open_alerts()]
    assert rec["gpus"] == ["GPU-0", "GPU-1"] and [a["pod"] for a in rec["allocations"]] == ["job-0", "job-1"]


def test_a_restored_alert_with_a_link_id_that_is_not_one_is_ignored() -> None:
    t = HealthTracker()
    t.await_clear(HOST, "0000:18:00.0", "nvlink_link:x")
    assert len(t.links) == 0 and t.awaiting_clear == {}
