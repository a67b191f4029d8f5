"""The topology reader through the NVML double (the real pynvml structs, constants and errors), and
the GpuTopology record through the codec."""

from __future__ import annotations

import pynvml
import pytest

from gpupipe.domain.gpu_topology import blast_radius, cpu_list, nvlink_domains
from gpupipe_producer.nvml.source import NvmlSource
from gpupipe_producer.nvml.topology import read_topology
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.records import GpuTopology
from tests.fake_nvml import FakeGpu, FakeNvml

NO_SYSFS = "/nonexistent"


def _read(nvml: FakeNvml, lost: tuple[str, ...] = ()):  # -> TopologyRead
    src = NvmlSource(nvml, "node-1", sysfs_pci=NO_SYSFS)
    src.start()
    return read_topology(nvml, src.gpus(), lost, sysfs_pci=NO_SYSFS)


def test_nvswitch_h100_node() -> None:
    nvml = FakeNvml.node("H100", 8)
    read = _read(nvml)
    g0, g5 = read.gpus[0], read.gpus[5]
    assert (g0["numa_node"], g5["numa_node"]) == (0, 1)
    assert (g0["cpu_affinity"], g5["cpu_affinity"]) == ("0-55,112-167", "56-111,168-223")
    assert g0["memory_numa_node"] is None  # x86: NotSupported
    assert len(g0["nvlinks"]) == 18  # probed until link 18 answered InvalidArgument
    assert g0["nvlinks"][0] == {
        "link": 0,
        "state": "active",
        "remote_type": "switch",
        "remote_pci_bus_id": None,  # FFFFFFFF:FF:FF.0: NVML does not resolve the switch
        "peer_uuid": None,
    }
    assert len(read.pairs) == 28 and all(p["nvlink_p2p"] for p in read.pairs)
    levels = {(p["gpu_a"], p["gpu_b"]): p["pcie_ancestor"] for p in read.pairs}
    assert levels[(0, 1)] == "node" and levels[(0, 5)] == "system"
    assert {g["nvlink_domain"] for g in read.gpus} == {0}
    assert not read.errors and not nvml.unimplemented_calls


def test_pcie_only_node() -> None:
    read = _read(FakeNvml.node("L40S", 4))
    assert all(g["nvlinks"] == [] and g["nvlink_domain"] is None for g in read.gpus)
    assert [(p["gpu_a"], p["gpu_b"], p["pcie_ancestor"], p["nvlink_p2p"]) for p in read.pairs] == [
        (0, 1, "single", False),
        (0, 2, "node", False),
        (0, 3, "node", False),
        (1, 2, "node", False),
        (1, 3, "node", False),
        (2, 3, "single", False),
    ]


def test_direct_links_name_their_peer_and_a_down_link_is_inactive() -> None:
    a, b, c = FakeGpu.a100(0), FakeGpu.a100(1), FakeGpu.a100(2)
    a.nvlink_remote = {i: (pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, b.pci_bus_id) for i in range(12)}
    b.nvlink_remote = {i: (pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, a.pci_bus_id) for i in range(12)}
    c.nvlink_links = 0  # a third GPU without NVLink
    a.nvlink_down = {11}
    read = _read(FakeNvml([a, b, c]))
    link0 = read.gpus[0]["nvlinks"][0]
    assert link0["remote_type"] == "gpu" and link0["peer_uuid"] == b.uuid
    assert link0["remote_pci_bus_id"] == b.pci_bus_id
    assert read.gpus[0]["nvlinks"][11] == {
        "link": 11,
        "state": "inactive",
        "remote_type": None,
        "remote_pci_bus_id": None,
        "peer_uuid": None,
    }
    assert [g["nvlink_domain"] for g in read.gpus] == [0, 0, None]


def test_unsupported_calls_leave_fields_null() -> None:
    nvml = FakeNvml.node("H100", 2)
    for g in nvml.gpus:
        g.unsupported |= {
            "nvmlDeviceGetCpuAffinity",
            "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetTopologyCommonAncestor",
            "nvmlDeviceGetP2PStatus",
            "nvmlDeviceGetMemoryAffinity",
        }
    read = _read(nvml)
    assert read.gpus[0]["cpu_affinity"] is None and read.gpus[0]["numa_node"] is None
    assert read.gpus[0]["nvlinks"] == []
    assert read.pairs == [{"gpu_a": 0, "gpu_b": 1, "pcie_ancestor": None, "nvlink_p2p": None}]
    assert ("nvlink_state:0" in {k for _, k, _ in read.learned}) and not read.errors


def test_a_transient_error_is_counted_and_the_read_goes_on() -> None:
    nvml = FakeNvml.node("H100", 2)
    nvml.gpus[0].fail("nvmlDeviceGetCpuAffinity", pynvml.NVML_ERROR_UNKNOWN)
    read = _read(nvml)
    assert read.gpus[0]["cpu_affinity"] is None and read.gpus[1]["cpu_affinity"] == "0-55,112-167"
    assert read.errors == {"NVMLError_Unknown": 1}


def test_a_lost_gpu_keeps_its_identity_and_is_in_no_pair() -> None:
    nvml = FakeNvml.node("H100", 3)
    src = NvmlSource(nvml, "node-1", sysfs_pci=NO_SYSFS)
    src.start()
    nvml.gpus[1].lose()  # falls off the bus after the source opened it
    read = read_topology(nvml, src.gpus(), sysfs_pci=NO_SYSFS)
    assert read.gpus[1]["gpu_lost"] and read.gpus[1]["uuid"] == nvml.gpus[1].uuid
    assert read.gpus[1]["nvlinks"] == []
    assert [(p["gpu_a"], p["gpu_b"]) for p in read.pairs] == [(0, 2)]
    assert blast_radius({"gpus": read.gpus}, nvml.gpus[0].uuid) == {nvml.gpus[2].uuid}


def test_record_round_trip_through_the_codec() -> None:
    read = _read(FakeNvml.node("H100", 8))
    record: GpuTopology = {
        "hostname": "node-1",
        "timestamp_ms": 1_795_000_000_000,
        "driver_version": "570.124.06",
        "gpus": read.gpus,
        "pairs": read.pairs,
    }
    codec = AvroCodec()
    for framing in ("single-object", "raw"):
        enc = codec.encoder("GpuTopology", "gpu.topology.v1", framing=framing)
        decoded = codec.decode(enc.encode(record), enc.headers)
        assert decoded.name == "GpuTopology" and decoded.record == record


@pytest.mark.parametrize(
    ("words", "text"),
    [([0xFF], "0-7"), ([0b1011], "0-1,3"), ([0, 1], "64"), ([0], ""), ([1 << 63, 1], "63-64")],
)
def test_cpu_list(words: list[int], text: str) -> None:
    assert cpu_list(words) == text


def test_nvlink_domains_are_islands() -> None:
    pairs = [
        {"gpu_a": 0, "gpu_b": 1, "nvlink_p2p": True},
        {"gpu_a": 2, "gpu_b": 3, "nvlink_p2p": True},
        {"gpu_a": 1, "gpu_b": 2, "nvlink_p2p": False},
        {"gpu_a": 3, "gpu_b": 4, "nvlink_p2p": None},
    ]
    assert nvlink_domains(range(5), pairs) == {0: 0, 1: 0, 2: 2, 3: 2, 4: None}
