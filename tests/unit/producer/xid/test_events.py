"""Pure tests of gpupipe_producer.xid.events: merger output / kernel reports -> XidEvent records."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe.domain import pci
from gpupipe_producer.kubelet.mapping import AllocationMap, build_allocation_map, pod_resources_from_dict
from gpupipe_producer.nvml.records import GpuRef
from gpupipe_producer.xid.events import (
    XidContext,
    build_xid_event,
    event_id,
    fallen_off_bus_event,
    kmsg_fields,
    nvml_fields,
)
from gpupipe_producer.xid.kmsg_parse import FallenOffBus, KernelXid, KmsgParser, parse_line
from gpupipe_producer.xid.xid_merge import XidMerger
from gpupipe_schemas.codec import AvroCodec
from tests.kubelet_fake import load_fixture
from tests.paths import TESTS

KMSG = TESTS / "fixtures" / "kmsg"
GPU0 = GpuRef(
    0, "GPU-8a1f0c3e-52d4-7b19-e6a0-3c5d9e7f20b0", "00000000:9B:00.0", "NVIDIA H100 80GB HBM3", "570.1"
)
GPU1 = GpuRef(1, "GPU-parent", "00000000:01:00.0", "NVIDIA H100 80GB HBM3", "570.1")
ALICE = "MIG-1a2b3c4d-5e6f-5071-8293-a4b5c6d7e8f9"
BOB = "MIG-2b3c4d5e-6f70-5182-93a4-b5c6d7e8f90a"
LINE_119 = (
    "[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, "
    "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) "
    "(0x2081 0x4)."
)
LINE_94_MIG = (
    "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No"
)
SXID = "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"

ENCODE = AvroCodec().encoder("XidEvent").encode


def ctx(amap: AllocationMap | None = None) -> XidContext:
    if amap is None:
        pods = pod_resources_from_dict(load_fixture("whole_gpus")) + pod_resources_from_dict(
            load_fixture("mig_mixed")
        )
        amap = build_allocation_map(pods)
    bus_map = {pci.device_key(g.pci_bus_id): g for g in (GPU0, GPU1)}

    def mig_lookup(uuid: str, gi: int | None, ci: int | None) -> str | None:
        return {("GPU-parent", 5): ALICE, ("GPU-parent", 6): BOB}.get((uuid, gi))

    return XidContext("node-1", bus_map, amap, slices={"GPU-parent": [ALICE, BOB]}, mig_lookup=mig_lookup)


def kx(line: str) -> KernelXid:
    ev = parse_line(line)
    assert isinstance(ev, KernelXid)
    return ev


def nvml_event(**kw: Any) -> dict[str, Any]:
    ev = {
        "xid": 119,
        "uuid": GPU0.uuid,
        "pci_bus_id": GPU0.pci_bus_id,
        "gpu_index": 0,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "timestamp_ms": 1_700_000_000_100,
    }
    ev.update(kw)
    return ev


def test_kmsg_only_xid_matched_to_a_gpu_by_bus_id() -> None:
    m = XidMerger(0.5)
    assert m.add("kmsg", "0000:9b:00", 119, 10.0, kmsg_fields(kx(LINE_119), 1_700_000_000_000)) == []
    (merged,) = m.expire(10.5)
    ev = build_xid_event(merged, ctx())
    assert ev == {
        "event_id": "node-1|kmsg|00000000:9B:00.0|xid119|1700000000000",
        "timestamp_ms": 1_700_000_000_000,
        "hostname": "node-1",
        "kind": "xid",
        "xid": 119,
        "pci_bus_id": "00000000:9B:00.0",
        "gpu_index": 0,
        "uuid": GPU0.uuid,
        "model_name": "NVIDIA H100 80GB HBM3",
        "driver_version": "570.1",
        "pid": 2024380,
        "process_name": "nvidia-smi",
        "message": kx(LINE_119).message,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "kmsg",
        "vendor": "nvidia",
        "allocations": [
            {
                "namespace": "ml-train",
                "pod": "llama-ft-0",
                "container": "trainer",
                "resource_name": "nvidia.com/gpu",
                "replica": None,
            }
        ],
    }
    assert ENCODE(ev)


def test_nvml_and_kmsg_within_the_window_are_one_event_with_both_sides_fields() -> None:
    m = XidMerger(0.5)
    assert m.add("nvml", GPU0.pci_bus_id, 119, 10.0, nvml_fields(nvml_event())) == []
    (merged,) = m.add("kmsg", "0000:9b:00", 119, 10.2, kmsg_fields(kx(LINE_119), 1_700_000_000_300))
    ev = build_xid_event(merged, ctx())
    assert ev["source"] == "nvml_kmsg"
    assert (ev["pid"], ev["process_name"], ev["uuid"], ev["gpu_index"]) == (
        2024380,
        "nvidia-smi",
        GPU0.uuid,
        0,
    )
    assert ev["timestamp_ms"] == 1_700_000_000_100  # the earlier sighting
    assert ev["pci_bus_id"] == "00000000:9B:00.0"
    assert ev["event_id"] == "node-1|nvml_kmsg|00000000:9B:00.0|xid119|1700000000100"
    assert "Timeout after 6s" in ev["message"]
    assert ENCODE(ev)


def test_nvml_only_event() -> None:
    m = XidMerger(0.5)
    m.add("nvml", GPU0.pci_bus_id, 79, 1.0, nvml_fields(nvml_event(xid=79)))
    (merged,) = m.flush()
    ev = build_xid_event(merged, ctx())
    assert (ev["source"], ev["xid"], ev["pid"], ev["message"], ev["uuid"]) == (
        "nvml",
        79,
        None,
        "",
        GPU0.uuid,
    )
    assert ENCODE(ev)


def test_mig_attributed_kmsg_xid_gets_the_slice_and_its_holder() -> None:
    m = XidMerger(0.0)
    m.add("kmsg", "0000:01:00", 94, 1.0, kmsg_fields(kx(LINE_94_MIG), 5))
    (merged,) = m.flush()
    ev = build_xid_event(merged, ctx())
    assert (ev["gpu_instance_id"], ev["mig_uuid"], ev["uuid"], ev["gpu_index"]) == (5, ALICE, "GPU-parent", 1)
    assert [a["pod"] for a in ev["allocations"]] == ["notebook-alice"]


def test_unattributed_xid_on_a_mig_gpu_hits_every_slice_holder() -> None:
    line = "NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"
    m = XidMerger(0.0)
    m.add("kmsg", "0000:01:00", 95, 1.0, kmsg_fields(kx(line), 5))
    ev = build_xid_event(m.flush()[0], ctx())
    assert ev["mig_uuid"] is None
    assert [a["pod"] for a in ev["allocations"]] == ["notebook-alice", "notebook-bob"]


def test_sxid_is_not_matched_to_a_gpu() -> None:
    m = XidMerger(0.5)
    (merged,) = m.add("kmsg", "0000:06:00.0", 20034, 1.0, kmsg_fields(kx(SXID), 7))
    ev = build_xid_event(merged, ctx())
    assert (ev["kind"], ev["xid"], ev["uuid"], ev["pci_bus_id"], ev["allocations"]) == (
        "sxid",
        20034,
        None,
        "0000:06:00.0",
        [],
    )
    assert ev["event_id"] == "node-1|kmsg|0000:06:00.0|sxid20034|7"
    assert ENCODE(ev)


def test_unknown_bus_id_keeps_the_kernel_form() -> None:
    line = "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping."
    m = XidMerger(0.0)
    m.add("kmsg", "0000:10:1c", 63, 1.0, kmsg_fields(kx(line), 9))
    ev = build_xid_event(m.flush()[0], ctx())
    assert (ev["pci_bus_id"], ev["uuid"], ev["gpu_index"], ev["model_name"]) == (
        "0000:10:1c",
        None,
        None,
        None,
    )
    assert ENCODE(ev)


def test_fallen_off_bus_from_the_real_multiline_report() -> None:
    p = KmsgParser()
    events = []
    for line in (KMSG / "fallen_off_bus_real.txt").read_text().splitlines():
        if not line.startswith("#"):
            events += p.feed(line)
    events += p.flush()
    fallen = [e for e in events if isinstance(e, FallenOffBus)]
    assert fallen
    gpu = GpuRef(3, "GPU-b3", "00000000:B3:00.0", "NVIDIA H100", "570.1")
    c = XidContext("node-1", {pci.device_key(gpu.pci_bus_id): gpu}, AllocationMap.empty())
    ev = fallen_off_bus_event(fallen[0], 42, c)
    assert (ev["kind"], ev["xid"], ev["uuid"], ev["gpu_index"], ev["source"]) == (
        "fallen_off_bus",
        None,
        "GPU-b3",
        3,
        "kmsg",
    )
    assert "fallen off the bus" in ev["message"]
    assert ev["event_id"] == "node-1|kmsg|00000000:B3:00.0|fallen_off_bus|42"
    assert ENCODE(ev)


def test_event_id_is_deterministic() -> None:
    assert event_id("h", "kmsg", "b", "xid79", 5) == "h|kmsg|b|xid79|5"
    m1, m2 = XidMerger(0.0), XidMerger(0.0)
    for m in (m1, m2):
        m.add("kmsg", "0000:9b:00", 119, 1.0, kmsg_fields(kx(LINE_119), 11))
    assert build_xid_event(m1.flush()[0], ctx()) == build_xid_event(m2.flush()[0], ctx())


REAL_XID_LINES = [
    ln for ln in (KMSG / "xid_real.txt").read_text().splitlines() if isinstance(parse_line(ln), KernelXid)
]


@pytest.mark.parametrize("line", REAL_XID_LINES)
def test_every_real_fixture_line_builds_an_encodable_event(line: str) -> None:
    ev = kx(line)
    m = XidMerger(0.0)
    m.add("kmsg", ev.pci_bus_id, ev.xid, 1.0, kmsg_fields(ev, 1))
    for merged in m.flush():
        assert ENCODE(build_xid_event(merged, ctx()))
