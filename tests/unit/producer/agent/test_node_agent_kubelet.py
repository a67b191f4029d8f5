"""Kubelet mapping on the real agent (fake NVML, a real gRPC fake kubelet).

* DRA: ``gpu.nvidia.com`` devices ``gpu-<minor>`` resolve to GPUs; ComputeDomain claims are mapped.
* ``nvidia<N>`` (GKE) is the device minor, not the NVML index.
* MIG slices advertised as ``<gpu>:<mig>`` (``deviceIDStrategy=index``) match.
* A finished pod an older kubelet still lists does not keep an exclusive GPU next to its new holder.
* One failed List keeps the last attribution for the grace period, flagged, then it is dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from gpupipe_producer.samples.enrich import ProcPod
from tests.agent_harness import (
    MIG_ALICE,
    MIG_EMBEDDER,
    UUIDS,
    metric,
    node_for_fixtures,
    running_agent,
    wait_for,
)
from tests.kubelet_fake import FakeKubelet
from tests.unit.producer.agent.test_node_agent import config, memory_publisher


def pod(
    name: str,
    devices: list[tuple[str, list[str]]] = (),  # type: ignore[assignment]
    claims: list[tuple[str, str]] = (),  # type: ignore[assignment]
    share_ids: dict[str, str] | None = None,
) -> dict:
    ctr: dict[str, Any] = {
        "name": "main",
        "devices": [{"resource_name": r, "device_ids": ids} for r, ids in devices],
        "dynamic_resources": [
            {
                "claim_name": f"{name}-claim",
                "claim_namespace": "ns",
                "claim_resources": [
                    {
                        "driver_name": drv,
                        "pool_name": "node-1",
                        "device_name": dev,
                        **({"share_id": share_ids[dev]} if share_ids and dev in share_ids else {}),
                    }
                    for drv, dev in claims
                ],
            }
        ]
        if claims
        else [],
    }
    return {"name": name, "namespace": "ns", "containers": [ctr]}


def _holders(mem: Any, uuid: str, mig: str | None = None) -> list[str]:
    def wanted(s: dict[str, Any]) -> bool:
        if s["uuid"] != uuid:
            return False
        return s["mig"] is None if mig is None else bool(s["mig"]) and s["mig"]["mig_uuid"] == mig

    recs = [s for s in mem.records("samples") if wanted(s)]
    return [a["pod"] for a in recs[-1]["allocations"]]


def test_dra_minor_numbers_and_mig_index_ids_are_attributed(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    fake.gpus[3].minor, fake.gpus[5].minor = 5, 3  # /dev/nvidia5 is NVML index 3, and the reverse
    answer = {
        "pod_resources": [
            pod(
                "dra-train", claims=[("gpu.nvidia.com", "gpu-5"), ("compute-domain.nvidia.com", "channel-0")]
            ),
            pod("gke-job", devices=[("nvidia.com/gpu", ["nvidia3"])]),
            pod("mig-idx", devices=[("nvidia.com/mig-1g.10gb", ["7:1"])]),
            pod("dra-mig", claims=[("gpu.nvidia.com", "gpu-7-mig-19-0-1")]),
        ]
    }
    pub, mem = memory_publisher()
    with (
        FakeKubelet(answer) as kubelet,
        running_agent(config(tmp_path, kubelet_socket=kubelet.socket_path), pub, fake) as ra,
    ):
        wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
        ra.ticks_after(2)
        assert metric(ra.registry, "gpupipe_producer_kubelet_dra_unresolved") == 1  # the MIG one
        ra.stop()
    assert _holders(mem, UUIDS[3]) == ["dra-train"], "gpu-5 is the GPU with minor 5 (index 3)"
    assert _holders(mem, UUIDS[5]) == ["gke-job"], "nvidia3 is /dev/nvidia3 (index 5)"
    assert _holders(mem, UUIDS[7], MIG_ALICE) == ["mig-idx"], "7:1 is MIG device index 1 of GPU 7"
    assert _holders(mem, UUIDS[0]) == []


def test_a_dra_mig_device_is_attributed_through_the_nodes_resource_slices(tmp_path: Path) -> None:
    """NVML cannot tell which MIG device a DRA name means; the driver's ResourceSlice says its UUID."""
    from tests.unit.producer.agent.test_dra_slices import FakeApi, _dev, _slice

    api = FakeApi({"v1": [_slice("node-1", [_dev("gpu-7-mig-19-0-1", MIG_ALICE)])]})
    answer = {"pod_resources": [pod("dra-mig", claims=[("gpu.nvidia.com", "gpu-7-mig-19-0-1")])]}
    pub, mem = memory_publisher()
    with (
        FakeKubelet(answer) as kubelet,
        running_agent(
            config(tmp_path, kubelet_socket=kubelet.socket_path, dra_api=api), pub, node_for_fixtures()
        ) as ra,
    ):
        wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
        ra.ticks_after(2)
        assert metric(ra.registry, "gpupipe_producer_kubelet_dra_unresolved") == 0
        ra.stop()
    assert _holders(mem, UUIDS[7], MIG_ALICE) == ["dra-mig"]
    assert api.paths and "fieldSelector=spec.nodeName%3D" in api.paths[0]
    # The claim travels with the allocation: chargeback bills by it, metrics label by it.
    last = [s for s in mem.records("samples") if s["mig"] and s["mig"]["mig_uuid"] == MIG_ALICE][-1]
    (a,) = last["allocations"]
    assert (a["resource_name"], a["claim_name"], a["claim_namespace"], a["dra_pool"], a["dra_device"]) == (
        "gpu.nvidia.com",
        "dra-mig-claim",
        "ns",
        "node-1",
        "gpu-7-mig-19-0-1",
    )
    assert a["dra_share_id"] is None  # a whole device: the kubelet sends no share_id
    plain = [s for s in mem.records("samples") if s["uuid"] == UUIDS[0] and not s["mig"]][-1]
    assert all(x["claim_name"] is None for x in plain["allocations"])


def test_the_share_id_of_a_dra_share_travels_with_each_claim(tmp_path: Path) -> None:
    """Kubernetes 1.35: two claims sharing one device (DRA consumable capacity) differ by share_id."""
    share_a, share_b = "6f1c1c3e-0b7e-4c4e-9f55-1f0d4b1c7a01", "6f1c1c3e-0b7e-4c4e-9f55-1f0d4b1c7a02"
    answer = {
        "pod_resources": [
            pod("share-a", claims=[("gpu.nvidia.com", "gpu-5")], share_ids={"gpu-5": share_a}),
            pod("share-b", claims=[("gpu.nvidia.com", "gpu-5")], share_ids={"gpu-5": share_b}),
        ]
    }
    pub, mem = memory_publisher()
    with (
        FakeKubelet(answer) as kubelet,
        running_agent(config(tmp_path, kubelet_socket=kubelet.socket_path), pub, node_for_fixtures()) as ra,
    ):
        wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
        ra.ticks_after(2)
        ra.stop()
    last = [s for s in mem.records("samples") if s["uuid"] == UUIDS[5] and not s["mig"]][-1]  # minor 5
    got = {(a["pod"], a["claim_name"], a["dra_share_id"]) for a in last["allocations"]}
    assert got == {("share-a", "share-a-claim", share_a), ("share-b", "share-b-claim", share_b)}


def test_a_finished_pod_still_listed_does_not_share_an_exclusive_gpu(tmp_path: Path) -> None:
    # Kubelets before 1.34 list Succeeded/Failed pods with their devices until they are deleted.
    answer = {
        "pod_resources": [
            pod("job-done", devices=[("nvidia.com/gpu", [UUIDS[0]])]),
            pod("job-now", devices=[("nvidia.com/gpu", [UUIDS[0]])]),
        ]
    }
    procs = {40_000: ProcPod(True, "uid-now", None, "ns", "job-now")}  # GPU 0 runs pid 40000
    pub, mem = memory_publisher()
    with FakeKubelet(answer) as kubelet:
        cfg = config(
            tmp_path, kubelet_socket=kubelet.socket_path, pid_resolver=procs.get, processes_interval_s=0.1
        )
        with running_agent(cfg, pub, node_for_fixtures()) as ra:
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
            ra.ticks_after(3)
            ra.stop()
    assert _holders(mem, UUIDS[0]) == ["job-now"]


def test_one_failed_list_keeps_the_last_attribution_for_the_grace_period(tmp_path: Path) -> None:
    answer = {"pod_resources": [pod("train", devices=[("nvidia.com/gpu", [UUIDS[1]])])]}
    pub, mem = memory_publisher()
    with FakeKubelet(answer) as kubelet:
        cfg = config(tmp_path, kubelet_socket=kubelet.socket_path, kubelet_grace_s=1.5)
        with running_agent(cfg, pub, node_for_fixtures()) as ra:
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
            kubelet.fail_with(grpc.StatusCode.UNAVAILABLE)
            wait_for(lambda: metric(ra.registry, "gpupipe_producer_kubelet_map_stale") == 1, 5, "flagged")
            ra.ticks_after(3)
            assert _holders(mem, UUIDS[1]) == ["train"], "a failed List does not blank attribution"
            wait_for(lambda: not ra.agent.allocations, 5, "dropped after the grace period")
            assert metric(ra.registry, "gpupipe_producer_kubelet_map_stale") == 0
            ra.ticks_after(2)
            ra.stop()
    assert _holders(mem, UUIDS[1]) == [], "then dropped, not kept forever"


def test_gpu_instance_ids_on_a_gpu_without_mig_are_ignored(tmp_path: Path) -> None:
    # Review §2: NVIDIA's mock reports GI/CI 0/0 for XIDs on non-MIG GPUs; they were published.
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path), pub, fake) as ra:
        ra.ticks_after(2)
        fake.gpus[0].inject_xid(48, gpu_instance_id=0, compute_instance_id=0)
        fake.gpus[7].inject_xid(94, gpu_instance_id=5, compute_instance_id=0)  # GPU 7 is in MIG mode
        wait_for(lambda: ra.agent.xids_sent >= 2, 5, "two XIDs")
        ra.stop()
    by_xid = {e["xid"]: e for e in mem.records("xid")}
    assert (by_xid[48]["gpu_instance_id"], by_xid[48]["mig_uuid"]) == (None, None)
    assert (by_xid[94]["gpu_instance_id"], by_xid[94]["mig_uuid"]) == (5, MIG_ALICE)


def test_mig_slices_by_gke_and_index_ids_get_their_samples_and_xids_attributed(tmp_path: Path) -> None:
    # Review 1.10: GKE advertises MIG slices as nvidia<minor>/gi<GPU instance id> ("not matched at
    # all"); and an XID on a slice was attributed through its MIG UUID only, so slices allocated by
    # "<gpu>:<mig>" ids (deviceIDStrategy=index) had pods on their samples but not on their XIDs.
    fake = node_for_fixtures()
    fake.gpus[7].minor = 2  # /dev/nvidia2 is NVML index 7
    answer = {
        "pod_resources": [
            pod("gke-mig", devices=[("nvidia.com/gpu", ["nvidia2/gi13"])]),
            pod("mig-idx", devices=[("nvidia.com/mig-1g.10gb", ["7:1"])]),
        ]
    }
    pub, mem = memory_publisher()
    with (
        FakeKubelet(answer) as kubelet,
        running_agent(config(tmp_path, kubelet_socket=kubelet.socket_path), pub, fake) as ra,
    ):
        wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
        ra.ticks_after(2)
        fake.gpus[7].inject_xid(43, gpu_instance_id=13, compute_instance_id=0)
        fake.gpus[7].inject_xid(31, gpu_instance_id=5, compute_instance_id=0)
        wait_for(lambda: ra.agent.xids_sent >= 2, 5, "two XIDs")
        ra.stop()
    assert _holders(mem, UUIDS[7], MIG_EMBEDDER) == ["gke-mig"], "nvidia2/gi13: GI 13 of /dev/nvidia2"
    assert _holders(mem, UUIDS[7], MIG_ALICE) == ["mig-idx"]
    by_xid = {e["xid"]: e for e in mem.records("xid")}
    assert [a["pod"] for a in by_xid[43]["allocations"]] == ["gke-mig"]
    assert [a["pod"] for a in by_xid[31]["allocations"]] == ["mig-idx"]
