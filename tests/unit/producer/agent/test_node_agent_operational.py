"""The node agent with GPU Operational Events: one XidEvent per incident, older drivers unharmed."""

from __future__ import annotations

from pathlib import Path

from tests.agent_harness import UUIDS, metric, node_for_fixtures, running_agent, wait_for
from tests.fake_nvml_operational import goe_event
from tests.unit.producer.agent.test_node_agent import config, memory_publisher

R620 = "620.10.01"
# The kernel's legacy line of the same incident, in the driver's Xid line layout (the R620 text of
# Xid 185 was not read: the message after the code is this test's own).
XID185_LINE = "[Sun Dec 13 10:00:00 2026] NVRM: Xid (PCI:0000:9b:00): 185, pid=4242, name=trainer, sparing\n"


def test_an_incident_reported_three_ways_is_published_once_as_the_structured_record(tmp_path: Path) -> None:
    fake = node_for_fixtures(driver_version=R620)
    pub, mem = memory_publisher()
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    cfg = config(tmp_path, kmsg_path=str(kmsg), xid_merge_window_s=2.0)
    with running_agent(cfg, pub, fake) as ra:
        wait_for(
            lambda: metric(ra.registry, "gpupipe_producer_operational_events_supported", {"gpu": "1"}) == 1
        )
        fake.inject_incident(1, goe_event("sparing_event"))  # NVML's Xid event and the structured one
        with kmsg.open("a") as f:
            f.write(XID185_LINE)
        wait_for(lambda: ra.agent.xids_sent >= 1, 10, "the incident's record")
        ra.stop()  # flushes whatever is still held: a late duplicate would show now
    events = mem.records("xid")
    assert len(events) == 1, events
    (rec,) = events
    op = rec["operational"]
    assert (rec["kind"], rec["xid"], rec["uuid"], rec["gpu_index"]) == ("xid", 185, UUIDS[1], 1)
    assert (rec["source"], rec["pid"], rec["process_name"]) == ("nvml_kmsg", 4242, "trainer")
    assert sorted(op["legacy_sources"]) == ["kmsg", "nvml"]
    assert (op["module_signature"], op["module_event_code"], op["legacy_xid"]) == ("GPU-RAS", 0x3D, 185)


def test_an_unknown_code_is_published_as_an_operational_record(tmp_path: Path) -> None:
    fake = node_for_fixtures(driver_version=R620)
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path), pub, fake) as ra:
        wait_for(
            lambda: metric(ra.registry, "gpupipe_producer_operational_events_supported", {"gpu": "2"}) == 1
        )
        fake.inject_operational(2, goe_event("unknown_code_memory"))
        wait_for(lambda: ra.agent.xids_sent >= 1, 10, "the operational record")
        ra.stop()
    (rec,) = mem.records("xid")
    assert (rec["kind"], rec["xid"], rec["uuid"], rec["source"]) == ("operational", None, UUIDS[2], "nvml")
    assert rec["operational"]["category"] == "MEMORY_INTEGRITY_ERROR"
    assert rec["operational"]["legacy_sources"] == []
    assert "GPU-RAS 0x0fff" in rec["message"]


def test_an_older_driver_keeps_legacy_xids_and_says_operational_events_are_unsupported(
    tmp_path: Path,
) -> None:
    fake = node_for_fixtures()  # driver 570: no operational-event symbols
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path), pub, fake) as ra:
        fake.gpus[1].inject_xid(119)
        wait_for(lambda: ra.agent.xids_sent >= 1, 10, "the legacy XID")
        unsupported = metric(
            ra.registry,
            "gpupipe_producer_nvml_unsupported_total",
            {"call": "nvmlEventSetRegisterGpuOperationalEvents_v1", "reason": "FunctionNotFound"},
        )
        supported = metric(ra.registry, "gpupipe_producer_operational_events_supported", {"gpu": "0"})
        ra.stop()
    (rec,) = mem.records("xid")
    assert (rec["xid"], rec["source"], rec.get("operational")) == (119, "nvml", None)
    assert unsupported == 8 and supported == 0
