"""The node agent with pod metadata (API-server double) and HPC job files: owners, labels and jobs
in every GpuSample and XidEvent allocation; the API going away flags them stale and samples keep flowing.

Same in-process harness as test_node_agent.py (fake NVML, fake kubelet over a real gRPC socket, an
in-memory librdkafka stand-in); the API server is tests/k8s_pods_fake.py over real HTTP.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpupipe.clients.kube import KubeClient, KubeConfig
from gpupipe.commands.cli import build_parser
from gpupipe.common.errors import ConfigError
from gpupipe_producer.agent.node_agent import config_from_args
from gpupipe_producer.podmeta.extras import AllocationExtras
from gpupipe_producer.podmeta.hpc_jobs import HpcJobMap, mapping_key, parse_job_file, read_mapping_dir
from gpupipe_producer.podmeta.kube_watch import PodMetadataWatcher
from gpupipe_schemas.validate import MAX_LABELS
from tests.agent_harness import (
    MIG_ALICE,
    SHARED,
    UUIDS,
    combined_fixture,
    find_line,
    metric,
    node_for_fixtures,
    running_agent,
    wait_for,
)
from tests.k8s_pods_fake import FakePodApi
from tests.kubelet_fake import FakeKubelet
from tests.unit.producer.agent.test_node_agent import config, memory_publisher

NODE = "node-1"


def cluster(api: FakePodApi) -> None:
    ptj = api.add_owner("kubeflow.org/v1", "PyTorchJob", "ml-train", "llama-ft")
    labels = {"team": "llm", "project": "llama", "x": "y"}
    api.add_pod("ml-train", "llama-ft-0", NODE, labels=labels, owner=ptj, priority_class="training")
    dep = api.add_owner("apps/v1", "Deployment", "team-a", "dev")
    rs = api.add_owner("apps/v1", "ReplicaSet", "team-a", "dev-7c9", owner=dep)
    api.add_pod("team-a", "dev-pod-1", NODE, labels={"team": "a"}, owner=rs)
    nb = api.add_owner("kubeflow.org/v1", "Notebook", "research", "alice")
    sts = api.add_owner("apps/v1", "StatefulSet", "research", "notebook-alice", owner=nb)
    api.add_pod("research", "notebook-alice", NODE, labels={"team": "research"}, owner=sts)


def test_owner_labels_hpc_jobs_in_samples_and_xids_and_api_outage(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    jobs = tmp_path / "hpc-jobs"
    jobs.mkdir()
    (jobs / "1").write_text("4242\n")
    (jobs / "7.5").write_text("5151\n\n5152\n")  # MIG GPU 7, GPU instance 5 (notebook-alice's slice)
    (jobs / "README").write_text("ignored\n")
    with FakePodApi() as api, FakeKubelet(combined_fixture()) as kubelet:
        cluster(api)
        watcher = PodMetadataWatcher(KubeClient(KubeConfig(api.url, None, None)), NODE, watch_timeout_s=30)
        extras = AllocationExtras(watcher, ("team", "project"), HpcJobMap(str(jobs), refresh_s=0.0))
        cfg = config(tmp_path, kubelet_socket=kubelet.socket_path, kmsg_path=str(kmsg), extras=extras)
        with running_agent(cfg, pub, fake) as ra:
            wait_for(lambda: len(ra.agent.allocations) > 0 and watcher.synced.is_set(), 5, "kubelet and API")
            ra.ticks_after(2)
            with kmsg.open("a") as f:
                f.write(find_line("xid_real.txt", "GPU-I:05") + "\n")  # Xid 94 on notebook-alice's slice
            wait_for(lambda: ra.agent.xids_sent >= 1, 10, "XID event")
            assert metric(ra.registry, "gpupipe_producer_pod_metadata_up") == 1
            mark = len(mem.records("samples"))
            api.stop()  # the API server goes away: samples keep flowing, flagged stale
            wait_for(lambda: not watcher.healthy, 10, "watch failure noticed")
            ra.ticks_after(2)
            assert metric(ra.registry, "gpupipe_producer_pod_metadata_up") == 0
            assert (
                metric(ra.registry, "gpupipe_producer_pod_metadata_errors_total", {"kind": "unreachable"})
                >= 1
            )
            assert metric(ra.registry, "gpupipe_producer_pod_metadata_requests_total", {"verb": "list"}) == 1
            ra.stop()
    samples = mem.records("samples")
    last = {}
    for s in samples[:mark]:
        last[s["mig"]["mig_uuid"] if s["mig"] else s["uuid"]] = s
    (llama,) = last[UUIDS[0]]["allocations"]
    assert (llama["owner_kind"], llama["owner_name"], llama["priority_class"], llama["metadata_status"]) == (
        "PyTorchJob",
        "llama-ft",
        "training",
        "ok",
    )
    assert llama["labels"] == {"team": "llm", "project": "llama"}  # only the selected keys
    dev1 = next(a for a in last[SHARED]["allocations"] if a["pod"] == "dev-pod-1")
    assert (dev1["owner_kind"], dev1["owner_name"]) == ("Deployment", "dev")
    dev2 = next(a for a in last[SHARED]["allocations"] if a["pod"] == "dev-pod-2")
    assert (dev2["metadata_status"], dev2["owner_kind"], dev2["labels"]) == ("unknown", None, {})
    # GPU 1: the kubelet's pod plus the HPC job from the mapping file.
    assert [(a["pod"], a["hpc_job"], a["owner_kind"]) for a in last[UUIDS[1]]["allocations"]] == [
        ("llama-ft-0", None, "PyTorchJob"),
        ("4242", "4242", "HpcJob"),
    ]
    alice = [(a["namespace"], a["pod"], a["hpc_job"]) for a in last[MIG_ALICE]["allocations"]]
    assert alice == [("research", "notebook-alice", None), ("hpc", "5151", "5151"), ("hpc", "5152", "5152")]
    (x94,) = [e for e in mem.records("xid") if e["xid"] == 94]
    assert [(a["pod"], a["owner_kind"], a["hpc_job"]) for a in x94["allocations"]] == [
        ("notebook-alice", "Notebook", None),
        ("5151", "HpcJob", "5151"),
        ("5152", "HpcJob", "5152"),
    ]
    after = [s for s in samples[mark:] if s["uuid"] == UUIDS[0]]
    assert after and after[-1]["allocations"][0]["metadata_status"] == "stale"
    assert after[-1]["allocations"][0]["owner_name"] == "llama-ft"


def test_job_files_format() -> None:
    assert parse_job_file("12\n\n 13 \n12\n") == ["12", "13"]
    assert mapping_key(2, None) == "2" and mapping_key(2, 0) == "2.0" and mapping_key(None, 1) is None


def test_mapping_dir_ignores_other_names_and_missing_dir(tmp_path: Path) -> None:
    assert read_mapping_dir(str(tmp_path / "absent")) == {}
    (tmp_path / "0").write_text("7\n")
    (tmp_path / "3.10").write_text("8\n")
    (tmp_path / "gpu0").write_text("9\n")
    (tmp_path / "4").mkdir()
    (tmp_path / "5").write_text("\n")
    assert read_mapping_dir(str(tmp_path)) == {"0": ["7"], "3.10": ["8"]}


def test_produce_flags_build_the_extras(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    args = build_parser().parse_args(
        ["produce", "--source", "nvml", "--pod-metadata", "api", "--kube-api-url", "http://127.0.0.1:1",
         "--kube-token-file", str(token), "--pod-labels", "team, cost-center", "--hpc-job-mapping-dir",
         str(tmp_path), "--hpc-namespace", "slurm", "--hostname", NODE]
    )  # fmt: skip
    assert isinstance(args, argparse.Namespace)
    extras = config_from_args(args).extras
    assert extras is not None and extras.label_keys == ("team", "cost-center")
    assert extras.watcher is not None and extras.watcher.node_name == NODE
    assert extras.hpc is not None and extras.hpc.namespace == "slurm"
    plain = build_parser().parse_args(["produce", "--source", "nvml"])
    assert config_from_args(plain).extras is None


def test_more_pod_labels_than_a_record_may_carry_are_refused_at_start(tmp_path: Path) -> None:
    keys = ",".join(f"label-{i}" for i in range(MAX_LABELS + 1))
    args = build_parser().parse_args(
        ["produce", "--source", "nvml", "--hpc-job-mapping-dir", str(tmp_path), "--pod-labels", keys]
    )
    with pytest.raises(
        ConfigError, match=f"--pod-labels selects {MAX_LABELS + 1} keys, at most {MAX_LABELS}"
    ):
        config_from_args(args)
