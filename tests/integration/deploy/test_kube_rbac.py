"""The chart's identities against a real Kubernetes API server: sufficient, and no more; DRA billing.

kube-apiserver and etcd run for real (tests/kube_apiserver.py); the ServiceAccounts, ClusterRoles
and bindings are the ones `helm template` renders from the chart, and their tokens are issued by
the API server. The alerts service's cordon, uncordon and cluster-share check, and the node agent's
pod metadata watch, run through gpupipe's own Kubernetes client with those tokens. Each verb the
alerts role grants is taken away once to show the step that needs it fails without it, and verbs
neither role grants are refused. With the producer's token, the node agent resolves DRA claims
through the driver's ResourceSlices on the server, and claims sharing a GPU are billed per claim.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupipe.clients.kube import KubeClient, KubeConfig
from gpupipe.domain.prices import load_price_table
from gpupipe_consumers.alerts.cordon import ANNOTATION_PREFIX, Cordoner, CordonResult, KubeNodeApi
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.report.workload_report import build_workload_report
from gpupipe_producer.podmeta.kube_watch import PodMetadataWatcher
from gpupipe_producer.samples.enrich import ProcPod
from tests.agent_harness import UUIDS, node_for_fixtures, running_agent, wait_for
from tests.fake_nvml import FakeProcess
from tests.integration.deploy.test_helm_chart import helm, render  # noqa: F401 (helm: the session fixture)
from tests.kube_apiserver import ApiError, KubeApiServer, object_path, start_kube_apiserver
from tests.kubelet_fake import FakeKubelet
from tests.paths import REPO
from tests.unit.producer.agent.test_node_agent import config, memory_publisher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

REPO = REPO
NS = "gpu"
NODES = ("node-a", "node-b", "node-c", "node-d")


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiServer]:
    yield from start_kube_apiserver(tmp_path_factory.mktemp("kube"))


@pytest.fixture(scope="module")
def chart(helm: str, kube: KubeApiServer) -> dict[str, dict[str, Any]]:  # noqa: F811
    """The chart's ServiceAccounts and RBAC created on the server; returned by "Kind/name"."""
    docs = render(helm, None, "alerts.flags.dry-run=false")
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    for name in NODES:
        kube.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    rbac = [
        d
        for d in docs
        if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    ]
    kube.apply_all(rbac)
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in rbac}


def _sa(chart: dict[str, dict[str, Any]], component: str) -> str:
    (name,) = [n for n, d in chart.items() if d["kind"] == "ServiceAccount" and n.endswith(f"-{component}")]
    return name.removeprefix("ServiceAccount/")


def _allowed(kube: KubeApiServer, token: str, verb: str, resource: str, group: str = "") -> bool:
    """What the API server's RBAC says now for the token's own identity."""
    review = kube.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "group": group}},
        },
        token=token,
    )
    return bool(review["status"].get("allowed"))


def _cordoner(kube: KubeApiServer, token_file: Path, **kw: Any) -> tuple[Cordoner, list[CordonResult]]:
    results: list[CordonResult] = []
    api = KubeNodeApi(KubeClient(KubeConfig(kube.url, str(token_file), str(kube.ca_file)), timeout_s=10))
    c = Cordoner(api, dry_run=False, max_per_hour=10, on_result=results.append, instance="t", **kw)
    return c, results


def _drain(node: str, aid: str) -> dict[str, Any]:
    return {"alert_id": aid, "hostname": node, "summary": f"CRITICAL: XID 79 on {node}", "drain_node": True}


def _node(kube: KubeApiServer, name: str) -> dict[str, Any]:
    return kube.request("GET", f"/api/v1/nodes/{name}")


def test_the_alerts_role_cordons_and_uncordons_on_a_real_api_server(
    kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    token = kube.service_account_token(NS, _sa(chart, "alerts"), tmp_path / "alerts.token")
    cordoner, results = _cordoner(kube, token, uncordon=True, max_share=0.5)
    assert cordoner.process(_drain("node-a", "a1")).outcome == "cordoned"
    node = _node(kube, "node-a")
    assert node["spec"]["unschedulable"] is True
    ann = node["metadata"]["annotations"]
    assert ann[ANNOTATION_PREFIX + "cordon-alert-id"] == "a1"
    assert ann[ANNOTATION_PREFIX + "cordoned-by"] == "gpupipe-alerts/t"
    # the cluster-side ledger reads the annotations back (list)
    fresh, _ = _cordoner(kube, token)
    assert fresh.restore_from_cluster() == 1
    # the share breaker: 2 of 4 nodes down would be more than half
    assert cordoner.process(_drain("node-b", "b1")).outcome == "cordoned"
    refused = cordoner.process(_drain("node-c", "c1"))
    assert refused.outcome == "rate_limited" and "2 of 4 nodes are unschedulable already" in refused.detail
    # node-a recovered (no open drain alert for it any more): --uncordon releases it, node-b stays
    cordoner._release({"node-b"})
    node = _node(kube, "node-a")
    assert not node["spec"].get("unschedulable")
    assert not [
        k for k in node["metadata"].get("annotations", {}) if k.startswith(ANNOTATION_PREFIX + "cordon")
    ]
    assert _node(kube, "node-b")["spec"]["unschedulable"] is True
    assert [r.outcome for r in results] == ["cordoned", "cordoned", "rate_limited"]


def _role_without(kube: KubeApiServer, role: dict[str, Any], verb: str | None) -> None:
    """Replace the ClusterRole's rules by the chart's, less ``verb`` (None: the chart's own)."""
    current = kube.request("GET", object_path(role))
    rules = copy.deepcopy(role["rules"])
    if verb is not None:
        for r in rules:
            r["verbs"] = [v for v in r["verbs"] if v != verb]
    kube.request("PUT", object_path(role), {**current, "rules": rules})


@pytest.mark.parametrize(
    ("verb", "outcome", "detail"),
    [
        ("get", "failed", "GET node"),
        ("list", "rate_limited", "cannot list nodes for the cluster-share limit"),
        ("patch", "failed", "PATCH node"),
    ],
)
def test_each_verb_the_alerts_role_grants_is_needed(
    kube: KubeApiServer,
    chart: dict[str, dict[str, Any]],
    tmp_path: Path,
    verb: str,
    outcome: str,
    detail: str,
) -> None:
    (role,) = [
        d for d in chart.values() if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-cordon")
    ]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}]
    token_file = kube.service_account_token(NS, _sa(chart, "alerts"), tmp_path / "alerts.token")
    token = token_file.read_text()
    _role_without(kube, role, verb)
    try:
        wait_for(lambda: not _allowed(kube, token, verb, "nodes"), 30, f"RBAC without {verb}")
        cordoner, _ = _cordoner(kube, token_file)
        result = cordoner.process(_drain("node-d", f"d-{verb}"))
        assert result.outcome == outcome and detail in result.detail, result
        assert "403" in result.detail or "Forbidden" in result.detail or "forbidden" in result.detail, result
        assert not _node(kube, "node-d")["spec"].get("unschedulable")
    finally:
        _role_without(kube, role, None)
        wait_for(lambda: _allowed(kube, token, verb, "nodes"), 30, "the chart's RBAC back")


def test_what_neither_role_grants_is_refused(
    kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    for component in ("alerts", "producer"):
        token = kube.service_account_token(
            NS, _sa(chart, component), tmp_path / f"{component}.token"
        ).read_text()
        for method, path in (
            ("DELETE", "/api/v1/nodes/node-c"),
            ("GET", f"/api/v1/namespaces/{NS}/secrets"),
            ("POST", f"/api/v1/namespaces/{NS}/pods/x/eviction"),
            ("PATCH", f"/api/v1/namespaces/{NS}/configmaps/x"),
        ):
            with pytest.raises(ApiError) as exc:
                kube.request(method, path, {} if method in ("POST", "PATCH") else None, token=token,
                             content_type="application/merge-patch+json")  # fmt: skip
            assert exc.value.status == 403, (component, method, path, exc.value)
    producer = kube.service_account_token(NS, _sa(chart, "producer"), tmp_path / "p.token").read_text()
    with pytest.raises(ApiError) as exc:  # the node agent reads nodes' pods, never patches a node
        kube.request("PATCH", "/api/v1/nodes/node-c", {"spec": {"unschedulable": True}}, token=producer,
                     content_type="application/merge-patch+json")  # fmt: skip
    assert exc.value.status == 403


def test_the_producer_role_watches_its_nodes_pods_and_walks_their_owners(
    kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    ns = "ml"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount",
                                                             "metadata": {"name": "default"}})  # fmt: skip
    labels = {"app": "train"}
    template = {
        "metadata": {"labels": labels},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }
    dep = kube.create(
        f"/apis/apps/v1/namespaces/{ns}/deployments",
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "train"},
         "spec": {"selector": {"matchLabels": labels}, "template": template}},
    )  # fmt: skip

    def owned_by(obj: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
                 "uid": obj["metadata"]["uid"], "controller": True}]  # fmt: skip

    rs = kube.create(
        f"/apis/apps/v1/namespaces/{ns}/replicasets",
        {"apiVersion": "apps/v1", "kind": "ReplicaSet",
         "metadata": {"name": "train-7d9", "ownerReferences": owned_by(dep)},
         "spec": {"selector": {"matchLabels": labels}, "template": template}},
    )  # fmt: skip
    pod_labels = {**labels, "team": "vision"}
    for pod, node in (("train-7d9-a", "node-a"), ("elsewhere", "node-b")):
        kube.create(
            f"/api/v1/namespaces/{ns}/pods",
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": pod, "labels": pod_labels, "ownerReferences": owned_by(rs)},
             "spec": {"nodeName": node, **template["spec"]}},
        )  # fmt: skip
    token = kube.service_account_token(NS, _sa(chart, "producer"), tmp_path / "producer.token")
    client = KubeClient(KubeConfig(kube.url, str(token), str(kube.ca_file)), timeout_s=10)
    errors: list[str] = []
    watcher = PodMetadataWatcher(client, "node-a", on_error=errors.append).start()
    try:
        assert watcher.synced.wait(30), errors
        meta = watcher.lookup(ns, "train-7d9-a")
        assert meta is not None, errors
        assert (meta.owner_kind, meta.owner_name, meta.labels.get("team")) == (
            "Deployment",
            "train",
            "vision",
        )
        assert watcher.lookup(ns, "elsewhere") is None  # another node's pod
        # a pod started later arrives through the watch
        kube.create(
            f"/api/v1/namespaces/{ns}/pods",
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "train-7d9-b", "labels": labels, "ownerReferences": owned_by(rs)},
             "spec": {"nodeName": "node-a", **template["spec"]}},
        )  # fmt: skip
        wait_for(lambda: watcher.lookup(ns, "train-7d9-b") is not None, 30, "the watched pod")
        assert not errors, errors
    finally:
        watcher.stop()


def _resource_slice(node: str, devices: dict[str, str]) -> dict[str, Any]:
    """A ResourceSlice as NVIDIA's DRA driver publishes one: its node's GPUs and MIG devices, with UUIDs."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": name, "attributes": {"uuid": {"string": uuid}, "type": {"string": "gpu"}}}
                for name, uuid in devices.items()
            ],
        },
    }


def test_the_producer_role_resolves_dra_devices_from_its_nodes_resource_slices(
    kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    from gpupipe_producer.agent.dra_slices import ResourceSliceIndex

    mig = "MIG-7c3e2a10-5b1d-5f0e-9a44-0d6a2b9c1e01"
    kube.create("/apis/resource.k8s.io/v1/resourceslices",
                _resource_slice("node-a", {"gpu-0": "GPU-aaaa", "gpu-1-mig-1g10gb-0": mig}))  # fmt: skip
    kube.create("/apis/resource.k8s.io/v1/resourceslices", _resource_slice("node-b", {"gpu-0": "GPU-bbbb"}))
    token = kube.service_account_token(NS, _sa(chart, "producer"), tmp_path / "producer.token")
    client = KubeClient(KubeConfig(kube.url, str(token), str(kube.ca_file)), timeout_s=10)
    errors: list[str] = []
    idx = ResourceSliceIndex(client, "node-a", ["gpu.nvidia.com"], on_error=errors.append)
    assert idx.uuid("gpu.nvidia.com", "node-a", "gpu-1-mig-1g10gb-0") == mig, errors
    assert idx.uuid("gpu.nvidia.com", "node-a", "gpu-0") == "GPU-aaaa"
    assert idx.uuid("gpu.nvidia.com", "node-b", "gpu-0") is None  # another node's slice is not read
    assert (idx.lists, len(idx), errors) == (1, 2, [])
    # the chart's role lists slices and does nothing else with them
    tok = token.read_text()
    verbs = ("list", "get", "watch", "create", "update", "delete")
    granted = [v for v in verbs if _allowed(kube, tok, v, "resourceslices", "resource.k8s.io")]
    assert granted == ["list"]


def test_claims_sharing_a_gpu_are_billed_per_claim_through_the_real_servers_slices(
    kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """DRA consumable shares, end to end: the driver's ResourceSlice on the real API server names GPU 0;
    two namespaces' claims hold it (kubelet over gRPC); the node agent, with the chart's producer
    token, attributes both and records each claim; chargeback bills each its measured use plus half
    the idle time."""
    kube.create("/apis/resource.k8s.io/v1/resourceslices", _resource_slice("node-1", {"gpu-0": UUIDS[0]}))
    token = kube.service_account_token(NS, _sa(chart, "producer"), tmp_path / "producer-dra.token")
    client = KubeClient(KubeConfig(kube.url, str(token), str(kube.ca_file)), timeout_s=10)

    def holder(ns: str, pod: str, claim: str) -> dict[str, Any]:
        res = {"driver_name": "gpu.nvidia.com", "pool_name": "node-1", "device_name": "gpu-0"}
        dyn = {"claim_name": claim, "claim_namespace": ns, "claim_resources": [res]}
        ctr = {"name": "main", "devices": [], "dynamic_resources": [dyn]}
        return {"name": pod, "namespace": ns, "containers": [ctr]}

    answer = {"pod_resources": [holder("team-a", "a-0", "big"), holder("team-b", "b-0", "small")]}
    fake = node_for_fixtures()
    fake.gpus[0].processes = [FakeProcess(pid=10, sm_util=60), FakeProcess(pid=20, sm_util=20)]
    procs = {
        10: ProcPod(True, "uid-a", None, "team-a", "a-0"),
        20: ProcPod(True, "uid-b", None, "team-b", "b-0"),
    }
    pub, mem = memory_publisher()
    with FakeKubelet(answer) as kubelet:
        cfg = config(tmp_path, kubelet_socket=kubelet.socket_path, dra_api=client, pid_resolver=procs.get,
                     processes_interval_s=0.1)  # fmt: skip
        with running_agent(cfg, pub, fake) as ra:
            wait_for(lambda: len(ra.agent.allocations.get(UUIDS[0], ())) == 2, 10, "both claims on GPU 0")
            wait_for(lambda: len([s for s in mem.records("samples") if _billable(s)]) >= 3, 10, "samples")
            ra.stop()
    samples = [s for s in mem.records("samples") if _billable(s)]
    assert {(a["claim_namespace"], a["claim_name"], a["dra_device"]) for a in samples[-1]["allocations"]} == {
        ("team-a", "big", "gpu-0"),
        ("team-b", "small", "gpu-0"),
    }
    eng = build_engine(ChargebackSettings(), load_price_table(REPO / "deploy" / "prices.example.yaml"), "t")
    for i, s in enumerate(samples):
        eng.add(s, 0, i)
    rows = build_workload_report(eng.flush_all(), by=("claim",), period="all")
    hours = {r.group: r.gpu_hours_allocated for r in rows if r.group in ("team-a/big", "team-b/small")}
    cost = {r.group: r.cost for r in rows if r.group in hours}
    total = sum(hours.values())
    # 0.6 + half of the idle 0.2 = 0.7 and 0.2 + 0.1 = 0.3 of every sample's time, the cost alike.
    assert hours["team-a/big"] / total == pytest.approx(0.7, rel=1e-9)
    assert cost["team-a/big"] / sum(cost.values()) == pytest.approx(0.7, rel=1e-9)


def _billable(s: dict[str, Any]) -> bool:
    """A sample of GPU 0 with both claims and both processes placed."""
    placed = {(p["namespace"], p["pod"]) for p in s["processes"] or ()}
    return (
        s["uuid"] == UUIDS[0]
        and len(s["allocations"]) == 2
        and placed == {("team-a", "a-0"), ("team-b", "b-0")}
    )
