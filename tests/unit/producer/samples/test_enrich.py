"""Pure tests of gpupipe_producer.samples.enrich: allocations and process -> pod attribution on samples."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe_producer.kubelet.mapping import AllocationMap, build_allocation_map, pod_resources_from_dict
from gpupipe_producer.nvml.records import empty_sample
from gpupipe_producer.samples.enrich import ProcPod, attribute_process, enrich_sample, gpu_aliases
from gpupipe_schemas.codec import AvroCodec
from tests.kubelet_fake import load_fixture

WHOLE = "GPU-8a1f0c3e-52d4-7b19-e6a0-3c5d9e7f20b0"
SHARED = "GPU-a0b1c2d3-e4f5-a6b7-c8d9-e0f1a2b3c4d5"
MIG_PARENT = "GPU-6f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
MIG_ALICE = "MIG-1a2b3c4d-5e6f-5071-8293-a4b5c6d7e8f9"


def amap_of(*fixtures: str, extra: tuple[str, ...] = ()) -> AllocationMap:
    pods = []
    for name in fixtures:
        pods += pod_resources_from_dict(load_fixture(name))
    return build_allocation_map(pods, extra)


def sample(uuid: str, index: int = 0, bus: str = "00000000:1B:00.0", **kw: Any) -> dict[str, Any]:
    s = empty_sample()
    s.update(timestamp_ms=1, hostname="n", gpu_index=index, uuid=uuid, pci_bus_id=bus, model_name="H100")
    s.update(kw)
    return s


def proc(pid: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "process_name": "python3",
        "used_memory_bytes": 1,
        "sm_util_ratio": 0.5,
        "mem_util_ratio": 0.1,
        "namespace": None,
        "pod": None,
        "container": None,
    }


def test_whole_gpu_by_uuid() -> None:
    s = enrich_sample(sample(WHOLE), amap_of("whole_gpus"))
    assert s["allocations"] == [
        {
            "namespace": "ml-train",
            "pod": "llama-ft-0",
            "container": "trainer",
            "resource_name": "nvidia.com/gpu",
            "replica": None,
        }
    ]


def test_unallocated_gpu_and_empty_map_give_no_allocations() -> None:
    assert (
        enrich_sample(sample("GPU-8a1f0c3e-52d4-7b19-e6a0-3c5d9e7f20b7"), amap_of("whole_gpus"))[
            "allocations"
        ]
        == []
    )
    assert enrich_sample(sample(WHOLE), AllocationMap.empty())["allocations"] == []


def test_time_slicing_replicas_give_one_allocation_per_holder() -> None:
    s = enrich_sample(sample(SHARED), amap_of("time_slicing"))
    assert [(a["namespace"], a["pod"], a["replica"]) for a in s["allocations"]] == [
        ("team-a", "dev-pod-1", 0),
        ("team-b", "dev-pod-2", 1),
    ]
    assert {a["resource_name"] for a in s["allocations"]} == {"nvidia.com/gpu.shared"}


def test_mig_slice_by_mig_uuid_and_parent_not_matched() -> None:
    amap = amap_of("mig_mixed")
    mig = {
        "mig_uuid": MIG_ALICE,
        "gpu_instance_id": 7,
        "compute_instance_id": 0,
        "profile": "1g.10gb",
        "slice_fraction": 1 / 7,
    }
    s = enrich_sample(sample("GPU-parent-of-slices", mig=mig), amap)
    assert [(a["pod"], a["resource_name"]) for a in s["allocations"]] == [
        ("notebook-alice", "nvidia.com/mig-1g.10gb")
    ]
    assert enrich_sample(sample("GPU-parent-of-slices", mig_enabled=True), amap)["allocations"] == []
    # The non-MIG GPU of the same fixture is found by UUID.
    assert enrich_sample(sample(MIG_PARENT), amap)["allocations"][0]["pod"] == "resnet-0"


def test_replicated_mig_device_is_found_by_mig_uuid() -> None:
    mig = {
        "mig_uuid": "MIG-c2d3e4f5-a6b7-5c8d-9e0f-a1b2c3d4e5f6",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g.10gb",
        "slice_fraction": 1 / 7,
    }
    s = enrich_sample(sample("GPU-x", mig=mig), amap_of("time_slicing"))
    assert [(a["pod"], a["replica"]) for a in s["allocations"]] == [("mig-shared-0", 7)]


def test_index_and_bus_id_aliases_from_odd_device_plugins() -> None:
    amap = amap_of("odd")
    by_index = enrich_sample(sample("GPU-no-such", index=1), amap)
    assert [a["pod"] for a in by_index["allocations"]] == ["index-ids"]
    by_bus = enrich_sample(sample("GPU-no-such", index=5, bus="00000000:3B:00.0"), amap)
    assert [a["pod"] for a in by_bus["allocations"]] == ["pci-ids"]
    gke = enrich_sample(sample("GPU-no-such", index=0, bus="00000000:99:00.0"), amap)
    assert sorted(a["pod"] for a in gke["allocations"]) == ["index-ids", "shared-a"]


def test_gpu_aliases() -> None:
    assert gpu_aliases(3, "00000000:3B:00.0") == ("3", "nvidia3", "00000000:3B:00.0", "0000:3b:00.0")
    assert gpu_aliases(None, None) == ()


# -- processes ----------------------------------------------------------------------------------


def test_exclusive_gpu_processes_get_the_holder_without_a_resolver() -> None:
    s = enrich_sample(sample(WHOLE, processes=[proc(10), proc(11)]), amap_of("whole_gpus"))
    assert [(p["namespace"], p["pod"], p["container"]) for p in s["processes"]] == [
        ("ml-train", "llama-ft-0", "trainer")
    ] * 2


def test_shared_gpu_processes_named_by_the_resolver() -> None:
    pods = {
        10: ProcPod(True, "uid-1", "c1", "team-a", "dev-pod-1"),
        11: ProcPod(True, "uid-2", "c2", "team-b", "dev-pod-2"),
        12: ProcPod(True, "uid-3", "c3"),  # pod not resolvable to a name
        13: ProcPod(False),  # host process
        14: None,  # not visible
    }
    s = enrich_sample(sample(SHARED, processes=[proc(p) for p in pods]), amap_of("time_slicing"), pods.get)
    got = [(p["pid"], p["namespace"], p["pod"], p["container"]) for p in s["processes"]]
    assert got == [
        (10, "team-a", "dev-pod-1", "main"),
        (11, "team-b", "dev-pod-2", "main"),
        (12, None, None, None),  # two holders: cannot guess
        (13, None, None, None),
        (14, None, None, None),
    ]


def test_host_process_on_exclusive_gpu_stays_unattributed() -> None:
    resolve = {10: ProcPod(False), 11: ProcPod(True, "uid", None)}.get
    s = enrich_sample(sample(WHOLE, processes=[proc(10), proc(11)]), amap_of("whole_gpus"), resolve)
    assert [(p["pod"], p["container"]) for p in s["processes"]] == [(None, None), ("llama-ft-0", "trainer")]


def test_pod_using_a_gpu_it_does_not_hold_is_still_named() -> None:
    resolve = {10: ProcPod(True, "u", "c", "rogue", "sneaky-0")}.get
    s = enrich_sample(sample(WHOLE, processes=[proc(10)]), amap_of("whole_gpus"), resolve)
    assert (s["processes"][0]["namespace"], s["processes"][0]["pod"], s["processes"][0]["container"]) == (
        "rogue",
        "sneaky-0",
        None,
    )


def test_resolver_errors_never_break_the_sample() -> None:
    def boom(pid: int) -> ProcPod | None:
        raise RuntimeError("procfs exploded")

    s = enrich_sample(sample(WHOLE, processes=[proc(10)]), amap_of("whole_gpus"), boom)
    assert s["processes"][0]["pod"] == "llama-ft-0"


def test_attribute_process_does_not_mutate_its_input() -> None:
    p = proc(1)
    out = attribute_process(p, [("a", "b", "c")], None)
    assert out["pod"] == "b" and p["pod"] is None


@pytest.mark.parametrize("fixture", ["whole_gpus", "mig_mixed", "time_slicing", "odd", "dra"])
def test_enriched_samples_encode(fixture: str) -> None:
    enc = AvroCodec().encoder("GpuSample").encode
    s = enrich_sample(sample(SHARED, processes=[proc(1)]), amap_of(fixture, extra=("example.com/accel",)))
    assert enc(s)
