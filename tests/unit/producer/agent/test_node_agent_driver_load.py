"""The node agent publishes the driver's load line as an XidEvent of kind ``driver_loaded``, and every
XidEvent with the node's boot id: the alerts' evidence of a driver reload or a reboot.

Kernel-log input is in the relay format (raw ``/dev/kmsg`` records); the load line is the real one from
NVSentinel#155 (``tests/fixtures/kmsg/driver_load_real.txt``).
"""

from __future__ import annotations

from pathlib import Path

from gpupipe_producer.kubelet.mapping import AllocationMap
from gpupipe_producer.xid.events import XidContext, driver_loaded_event
from gpupipe_producer.xid.kmsg_parse import parse_driver_load
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import node_for_fixtures, running_agent, wait_for
from tests.unit.producer.agent.test_node_agent import memory_publisher
from tests.unit.producer.agent.test_node_agent_resilience import XID48, _kmsg_config, record

LOADED = (
    "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build  "
    "(dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025"
)


def test_driver_loaded_event_is_node_wide_and_encodes() -> None:
    ev = parse_driver_load("[ 1843.439669] " + LOADED)
    assert ev is not None
    rec = driver_loaded_event(ev, 1_800_000_000_000, XidContext("node-1", {}, AllocationMap.empty()), 7)
    assert (rec["kind"], rec["xid"], rec["pci_bus_id"], rec["driver_version"], rec["source"]) == (
        "driver_loaded",
        None,
        "",
        "570.158.01",
        "kmsg",
    )
    assert rec["message"] == LOADED
    assert rec["event_id"] == "node-1|kmsg||driver_loaded|1800000000000|s7"
    codec = AvroCodec()
    back = codec.decode(codec.encoder("XidEvent").encode({**rec, "boot_id": "b0a7-1"})).record
    assert back["kind"] == "driver_loaded" and back["boot_id"] == "b0a7-1"


def test_agent_publishes_the_load_line_and_the_boot_id_on_every_event(tmp_path: Path) -> None:
    kmsg, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("b0a7-2\n")
    kmsg.write_text(record(0, "Linux version ...") + record(3, LOADED, 12_345_678) + record(9, XID48))
    pub, mem = memory_publisher()
    with running_agent(_kmsg_config(tmp_path, kmsg, boot), pub, node_for_fixtures()) as ra:
        wait_for(lambda: ra.agent.xids_sent >= 2, 5, "the load line and the Xid 48")
        ra.stop()
    events = {e["kind"]: e for e in mem.records("xid")}
    assert set(events) == {"driver_loaded", "xid"}
    loaded = events["driver_loaded"]
    assert (loaded["xid"], loaded["pci_bus_id"], loaded["driver_version"]) == (None, "", "570.158.01")
    assert loaded["event_id"].endswith("|s3")
    assert {e["boot_id"] for e in events.values()} == {"b0a7-2"}
