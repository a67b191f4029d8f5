"""Pure tests of gpupipe_producer.kubelet.mapping (no gRPC, no sockets)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from gpupipe_producer.kubelet import mapping
from gpupipe_producer.kubelet.mapping import (
    AllocationMap,
    AllocationMapper,
    ContainerDevices,
    ContainerResources,
    DraDeviceKey,
    PodRef,
    PodResources,
    build_allocation_map,
    lookup,
    pod_resources_from_dict,
    split_device_id,
)
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "kubelet"
FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def ref(row: list) -> PodRef:
    return PodRef(*row)


def build(fx: dict, **kw) -> AllocationMap:
    mapper = AllocationMapper(tuple(fx.get("extra_resource_names", ())), **kw)
    return mapper.build(pod_resources_from_dict(fx))


def expected_devices(fx: dict) -> dict[str, tuple[PodRef, ...]]:
    return {k: tuple(ref(r) for r in rows) for k, rows in fx["expected"]["devices"].items()}


def test_fixture_set_is_complete():
    assert {"whole_gpus", "mig_mixed", "time_slicing", "churn_before", "churn_after", "odd", "dra"} <= set(
        FIXTURE_NAMES
    )


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_maps_as_expected(name):
    fx = load(name)
    amap = build(fx)
    assert dict(amap) == expected_devices(fx)
    assert dict(amap.ignored_resources) == fx["expected"]["ignored_resources"]
    assert amap.odd_device_ids == fx["expected"]["odd_device_ids"]
    for key in fx["expected"].get("unallocated", []):
        assert key not in amap
        assert lookup(amap, key) == ()
    if "dra" in fx["expected"]:
        want = {DraDeviceKey(*k): tuple(ref(r) for r in rows) for k, rows in fx["expected"]["dra"]}
        assert dict(amap.dra) == want


def test_whole_gpus_lookup():
    fx = load("whole_gpus")
    amap = build(fx)
    gpus = fx["allocatable"]["devices"][0]["device_ids"]
    assert len(gpus) == 8
    (r,) = lookup(amap, gpus[0])
    assert (r.namespace, r.pod, r.container, r.resource_name, r.replica) == (
        "ml-train",
        "llama-ft-0",
        "trainer",
        "nvidia.com/gpu",
        None,
    )
    assert lookup(amap, gpus[7]) == ()
    assert amap.pods() == {
        ("ml-train", "llama-ft-0"),
        ("ml-train", "bert-sweep-7"),
        ("inference", "llm-serve-6d9f-abcde"),
    }


def test_mig_lookup_uses_the_slice_not_the_parent():
    fx = load("mig_mixed")
    amap = build(fx)
    parent = next(iter(fx["mig_parent"].values()))
    slices = sorted(fx["mig_parent"])
    assert lookup(amap, parent) == ()  # a MIG-enabled GPU is never allocated whole
    by_profile = {}
    for mig_uuid in slices:
        for r in lookup(amap, parent, mig_uuid):
            by_profile.setdefault(r.resource_name, []).append(r.pod)
    assert sorted(by_profile["nvidia.com/mig-1g.10gb"]) == ["embedder-0", "notebook-alice", "notebook-bob"]
    assert by_profile["nvidia.com/mig-3g.40gb"] == ["reranker-0"]


def test_time_slicing_maps_uuid_to_all_sharing_pods():
    fx = load("time_slicing")
    amap = build(fx)
    gpu_a = "GPU-a0b1c2d3-e4f5-a6b7-c8d9-e0f1a2b3c4d5"
    refs = lookup(amap, gpu_a)
    assert [(r.pod, r.replica) for r in refs] == [("dev-pod-1", 0), ("dev-pod-2", 1)]
    assert all(r.resource_name == "nvidia.com/gpu.shared" for r in refs)
    assert gpu_a + "::0" not in amap  # the replica suffix never is a key


def test_churn_ended_pod_disappears():
    before, after = build(load("churn_before")), build(load("churn_after"))
    assert ("team-a", "job-old") in before.pods()
    assert ("team-a", "job-old") not in after.pods()
    assert ("team-c", "job-new") in after.pods()


@pytest.mark.parametrize(
    ("device_id", "want"),
    [
        ("GPU-abc", ("GPU-abc", None, False)),
        ("MIG-abc", ("MIG-abc", None, False)),
        ("GPU-abc::0", ("GPU-abc", 0, False)),
        ("GPU-abc::12", ("GPU-abc", 12, False)),
        ("MIG-GPU-abc/1/0", ("MIG-GPU-abc/1/0", None, False)),
        ("MIG-abc::7", ("MIG-abc", 7, False)),
        ("nvidia0/vgpu3", ("nvidia0", 3, False)),
        ("nvidia0/gi3", ("nvidia0/gi3", None, False)),
        ("nvidia0/gi3/vgpu1", ("nvidia0/gi3", 1, False)),
        ("0000:3b:00.0", ("0000:3b:00.0", None, False)),
        ("3", ("3", None, False)),
        (" GPU-abc::2 ", ("GPU-abc", 2, False)),
        ("::3", ("::3", None, True)),
        ("GPU-abc::", ("GPU-abc::", None, True)),
        ("GPU-abc::x", ("GPU-abc::x", None, True)),
        ("GPU-abc::\u0661", ("GPU-abc::\u0661", None, True)),  # non-ASCII digit
    ],
)
def test_split_device_id(device_id, want):
    assert split_device_id(device_id) == want


@pytest.mark.parametrize(
    ("name", "wanted"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/gpu.shared", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("nvidia.com/mig-3g.40gb", True),
        ("nvidia.com/mig-1g.5gb+me", True),
        ("nvidia.com/mig-", False),
        ("nvidia.com/gpux", False),
        ("nvidia.com/GPU", False),
        ("cpu", False),
        ("", False),
        ("example.com/accel", True),
        ("vendor.io/gpu-a", True),
        ("vendor.io/gpu-", False),
    ],
)
def test_resource_filter(name, wanted):
    mapper = AllocationMapper(("example.com/accel", "vendor.io/gpu-*", "*", ""))
    assert mapper.wants(name) is wanted


def test_unknown_resources_are_ignored_and_counted():
    pods = [
        PodResources(
            "p",
            "ns",
            (
                ContainerResources(
                    "c",
                    (
                        ContainerDevices("example.com/fpga", ("a", "b")),
                        ContainerDevices("example.com/fpga", ("c",)),
                        ContainerDevices("nvidia.com/gpu", ("GPU-1",)),
                    ),
                ),
            ),
        )
    ]
    amap = build_allocation_map(pods)
    assert list(amap) == ["GPU-1"]
    assert amap.ignored_resources == {"example.com/fpga": 2}
    assert "GPU-1" in build_allocation_map(pods, ["example.com/fpga"])
    assert "a" in build_allocation_map(pods, ["example.com/fpga"])


def test_garbage_values_never_crash():
    weird = (None, 5, b"GPU-x", "", "GPU-ok", object())
    pods = [
        PodResources(
            "p",
            "ns",
            (
                ContainerResources("c", (ContainerDevices("nvidia.com/gpu", weird),)),  # type: ignore[arg-type]
                ContainerResources("d", (ContainerDevices(None, ("GPU-z",)),)),  # type: ignore[arg-type]
            ),
        )
    ]
    amap = build_allocation_map(pods)
    assert list(amap) == ["GPU-ok"]
    assert amap.odd_device_ids == 5
    assert amap.ignored_resources == {"None": 1}


def test_refs_are_sorted_and_deduplicated_independent_of_input_order():
    def pods(order):
        return [
            PodResources(
                n, "ns", (ContainerResources("c", (ContainerDevices("nvidia.com/gpu.shared", (i,)),)),)
            )
            for n, i in order
        ]

    a = [("p2", "GPU-1::1"), ("p1", "GPU-1::0"), ("p1", "GPU-1::0"), ("p3", "GPU-1")]
    m1, m2 = build_allocation_map(pods(a)), build_allocation_map(pods(reversed(a)))
    assert m1 == m2
    assert [(r.pod, r.replica) for r in m1["GPU-1"]] == [("p1", 0), ("p2", 1), ("p3", None)]


def test_lookup_aliases_for_non_uuid_device_ids():
    amap = build(load("odd"))
    # the device plugin advertised index "0" / a PCI id: the caller passes them as aliases
    assert [r.pod for r in lookup(amap, "GPU-not-advertised", aliases=["0"])] == ["index-ids"]
    assert [r.pod for r in lookup(amap, "GPU-x", aliases=["7", "0000:3b:00.0"])] == ["pci-ids"]
    assert lookup(amap, "", None) == ()
    assert lookup(AllocationMap.empty(), "GPU-x", "MIG-y", aliases=["0"]) == ()


def test_dra_resolver_indexes_claims_under_uuid():
    fx = load("dra")
    uuids = fx["dra_uuids"]
    seen = []

    def resolve(driver, pool, device):
        seen.append((driver, pool, device))
        return uuids.get(device)

    amap = build(fx, dra_device_resolver=resolve)
    assert ("net.example.com", "node-a", "eth1") not in seen  # other drivers are not mapped
    shared = lookup(amap, uuids["gpu-1"])
    assert [(r.pod, r.claim_name, r.resource_name) for r in shared] == [
        ("helper-0", "shared-gpu", "gpu.nvidia.com"),
        ("trainer-0", "trainer-0-gpus", "gpu.nvidia.com"),
    ]
    # other DRA drivers can be opted in
    nic = build(fx, dra_driver_names=("gpu.nvidia.com", "net.example.com"))
    assert DraDeviceKey("net.example.com", "node-a", "eth1") in nic.dra


def test_from_dict_accepts_camel_case_and_rejects_non_mapping():
    doc = {
        "podResources": [
            {
                "name": "p",
                "namespace": "ns",
                "containers": [
                    {"name": "c", "devices": [{"resourceName": "nvidia.com/gpu", "deviceIds": ["GPU-1"]}]}
                ],
            }
        ]
    }
    assert lookup(build_allocation_map(pod_resources_from_dict(doc)), "GPU-1") == (
        PodRef("ns", "p", "c", "nvidia.com/gpu"),
    )
    with pytest.raises(TypeError):
        pod_resources_from_dict([])  # type: ignore[arg-type]
    assert pod_resources_from_dict({"pod_resources": "nonsense"}) == ()


def test_empty_map():
    empty = AllocationMap.empty()
    assert not empty and len(empty) == 0 and empty.pods() == frozenset()
    assert empty == AllocationMap()
    assert not build_allocation_map([])


def test_mapping_module_is_pure():
    tree = ast.parse(Path(mapping.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"grpc", "google", "socket", "producer"}, imported
