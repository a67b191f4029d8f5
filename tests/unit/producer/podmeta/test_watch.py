"""Pod metadata from a node-scoped watch, against a faithful API server double over real sockets."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from gpupipe.clients.kube import KubeClient, KubeConfig
from gpupipe_producer.podmeta.kube_watch import PodMetadataWatcher
from gpupipe_producer.podmeta.owners import annotate, object_path, plural
from tests.k8s_pods_fake import FakePodApi

NODE = "gpu-node-1"


def wait(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def populate(api: FakePodApi) -> None:
    dep = api.add_owner("apps/v1", "Deployment", "serving", "llm-api")
    rs = api.add_owner("apps/v1", "ReplicaSet", "serving", "llm-api-7d9f8", owner=dep)
    api.add_pod("serving", "llm-api-7d9f8-abcde", NODE, labels={"team": "ml", "app": "llm"}, owner=rs,
                priority_class="production")  # fmt: skip
    api.add_pod("serving", "llm-api-7d9f8-fghij", NODE, labels={"team": "ml"}, owner=rs)
    cron = api.add_owner("batch/v1", "CronJob", "etl", "nightly")
    job = api.add_owner("batch/v1", "Job", "etl", "nightly-29012345", owner=cron)
    api.add_pod("etl", "nightly-29012345-x1", NODE, labels={"cost-center": "cc-7"}, owner=job)
    nb = api.add_owner("kubeflow.org/v1", "Notebook", "notebooks", "alice")
    sts = api.add_owner("apps/v1", "StatefulSet", "notebooks", "alice", owner=nb)
    api.add_pod("notebooks", "alice-0", NODE, labels={"team": "research"}, owner=sts)
    ptj = api.add_owner("kubeflow.org/v1", "PyTorchJob", "train", "gpt")
    api.add_pod("train", "gpt-master-0", NODE, owner=ptj)
    api.add_pod("default", "debug", NODE)
    api.add_pod("serving", "elsewhere", "other-node", owner=rs)


@pytest.fixture
def api() -> Iterator[FakePodApi]:
    with FakePodApi(token="tok") as fake:
        populate(fake)
        yield fake


@pytest.fixture
def watcher(api: FakePodApi, tmp_path) -> Iterator[PodMetadataWatcher]:
    token = tmp_path / "token"
    token.write_text("tok\n")
    w = PodMetadataWatcher(KubeClient(KubeConfig(api.url, str(token), None)), NODE, watch_timeout_s=30)
    w.start()
    try:
        assert w.synced.wait(10)
        yield w
    finally:
        w.stop()


def test_owner_chains_labels_priority_and_node_scope(api: FakePodApi, watcher: PodMetadataWatcher) -> None:
    owners = {
        (m.namespace, m.name): (m.owner_kind, m.owner_name)
        for m in (watcher.lookup(*k) for k in [
            ("serving", "llm-api-7d9f8-abcde"), ("etl", "nightly-29012345-x1"), ("notebooks", "alice-0"),
            ("train", "gpt-master-0"), ("default", "debug")])
        if m is not None
    }  # fmt: skip
    assert owners == {
        ("serving", "llm-api-7d9f8-abcde"): ("Deployment", "llm-api"),
        ("etl", "nightly-29012345-x1"): ("CronJob", "nightly"),
        ("notebooks", "alice-0"): ("Notebook", "alice"),
        ("train", "gpt-master-0"): ("PyTorchJob", "gpt"),
        ("default", "debug"): ("Pod", "debug"),
    }
    assert watcher.lookup("serving", "elsewhere") is None  # another node's pod is never listed
    assert len(watcher) == 6
    meta = watcher.lookup("serving", "llm-api-7d9f8-abcde")
    assert meta is not None and meta.priority_class == "production" and meta.labels["app"] == "llm"
    # Owners are fetched once per controller object, not per pod: RS+Deploy, Job+CronJob, STS+Notebook, PTJ.
    assert api.count("get") == 7 and api.count("list") == 1


def test_watch_follows_changes_and_relists_after_410(api: FakePodApi, watcher: PodMetadataWatcher) -> None:
    rs = api.add_owner("apps/v1", "ReplicaSet", "serving", "solo-5f5f")  # a ReplicaSet without Deployment
    api.add_pod("serving", "solo-5f5f-1", NODE, labels={"team": "a"}, owner=rs)
    wait(lambda: watcher.lookup("serving", "solo-5f5f-1") is not None)
    assert watcher.lookup("serving", "solo-5f5f-1").owner_kind == "ReplicaSet"  # type: ignore[union-attr]
    api.set_labels("serving", "solo-5f5f-1", {"team": "b"})
    wait(lambda: watcher.lookup("serving", "solo-5f5f-1").labels.get("team") == "b")  # type: ignore[union-attr]
    api.delete_pod("default", "debug")
    wait(lambda: watcher.lookup("default", "debug") is None)
    # The API server goes away; meanwhile pods change and etcd compacts. Resuming the watch from the
    # last version seen gets 410 Expired, so the watcher relists and sees the change.
    api.stop()
    wait(lambda: not watcher.healthy)  # its stream has ended: what follows it must learn by relisting
    api.add_pod("default", "after-compaction", NODE)
    api.compact()
    api.restart()
    wait(lambda: watcher.relists == 2, timeout=15)
    wait(lambda: watcher.lookup("default", "after-compaction") is not None)
    assert watcher.healthy


def test_http_410_on_watch_relists(tmp_path) -> None:
    with FakePodApi(gone_as_http=True) as api:
        populate(api)
        w = PodMetadataWatcher(KubeClient(KubeConfig(api.url, None, None)), NODE, watch_timeout_s=30)
        w.start()
        try:
            assert w.synced.wait(10)
            api.stop()
            wait(lambda: not w.healthy)
            api.add_pod("default", "after-compaction", NODE)
            api.compact()
            api.restart()
            wait(lambda: w.relists == 2, timeout=15)
            assert w.lookup("default", "after-compaction") is not None
        finally:
            w.stop()


def test_api_down_keeps_last_known_flagged_stale_and_recovers(
    api: FakePodApi, watcher: PodMetadataWatcher
) -> None:
    alloc = [{"namespace": "notebooks", "pod": "alice-0"}, {"namespace": "x", "pod": "never-seen"}]
    annotate(alloc, watcher.lookup, ("team", "project"), watcher.healthy)
    assert alloc[0]["metadata_status"] == "ok" and alloc[0]["labels"] == {"team": "research"}
    assert alloc[1]["metadata_status"] == "unknown" and alloc[1]["owner_kind"] is None
    api.stop()
    wait(lambda: not watcher.healthy)
    annotate(alloc, watcher.lookup, ("team",), watcher.healthy)
    assert (alloc[0]["metadata_status"], alloc[0]["owner_kind"]) == ("stale", "Notebook")
    api.restart()
    api.add_pod("default", "while-down", NODE)
    wait(lambda: watcher.healthy and watcher.lookup("default", "while-down") is not None, timeout=15)


def test_paths_and_plurals() -> None:
    assert object_path("apps/v1", "ReplicaSet", "ns", "x") == "/apis/apps/v1/namespaces/ns/replicasets/x"
    assert (
        object_path("v1", "ReplicationController", "ns", "x")
        == "/api/v1/namespaces/ns/replicationcontrollers/x"
    )
    assert [plural(k) for k in ("RayCluster", "PyTorchJob", "NetworkPolicy", "Ingress")] == [
        "rayclusters",
        "pytorchjobs",
        "networkpolicies",
        "ingresses",
    ]
