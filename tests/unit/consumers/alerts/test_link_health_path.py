"""NVLink link health end to end in one process: the node agent's NVML source on the NVML double (the
real pynvml calls), its samples encoded and decoded as the alerts service decodes them, and the
service's handler raising GpuNvLinkDegrading for the one link whose counters keep rising."""

from __future__ import annotations

import pynvml
from prometheus_client import CollectorRegistry

from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.alerts.sample_decode import AlertsDecoder
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_schemas.codec import AvroCodec
from tests.fake_nvml import FakeNvml
from tests.unit.producer.nvml.test_source import make

REPLAY = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
FLIT = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT


def test_rising_counters_on_one_link_raise_a_warning_naming_it_and_its_domain() -> None:
    fake = FakeNvml.node("H100", 2)
    _, src, clock, _ = make(fake, intervals={"fast": 10.0, "fabric": 10.0})
    codec = AvroCodec()
    enc, dec = codec.encoder("GpuSample", "gpu.samples.v1"), AlertsDecoder(codec)
    now = {"ms": 0}
    svc = AlertsHandler(sink=ListSink(), registry=CollectorRegistry(), clock=lambda: now["ms"] / 1000)
    offset = 0
    g0 = fake.gpus[0]
    for minute in range(7):
        if minute >= 1:  # link 4 of GPU 0 starts to go bad: a few errors every minute
            for counter in (FLIT, REPLAY):
                g0.nvlink_dl_errors[(4, counter)] = g0.nvlink_dl_errors.get((4, counter), 0) + 3
        for _ in range(6):
            clock.advance(10.0)
            for s in src.poll():
                d = dec.decode(enc.encode(s))
                now["ms"] = max(now["ms"], d.record["timestamp_ms"])
                offset += 1
                assert (
                    svc.handle([InRecord("gpu.samples.v1", 0, offset, None, d.name, d.record, now["ms"])])
                    == []
                )
    src.shutdown()
    alerts = [r for r in svc.sink.records if r["alertname"] == "GpuNvLinkDegrading"]
    assert alerts, [r["alertname"] for r in svc.sink.records]
    rec = alerts[-1]
    assert (rec["signal"], rec["severity"], rec["status"], rec["gpu_uuid"]) == (
        "nvlink_link:4",
        "warning",
        "firing",
        g0.uuid,
    )
    assert rec["gpus"] == [g0.uuid, fake.gpus[1].uuid]
    assert "NVLink link 4 (peer nvswitch) degrading" in rec["description"]
    assert {r["signal"] for r in svc.sink.records if r["alertname"] == "GpuNvLinkDegrading"} == {
        "nvlink_link:4"
    }
