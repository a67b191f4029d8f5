"""The services themselves, as their CLIs run, against a real Kubernetes API server with the chart's RBAC.

kube-apiserver and etcd run for real (tests/kube_apiserver.py); the ServiceAccounts, roles and bindings
are the chart's, their tokens issued by the server, and its CA is the one the services check it with.

* ``gpupipe alerts --cordon --uncordon`` (real Kafka): an Xid 79 cordons its node; a restarted service
  keeps it cordoned while the GPU is still off the bus; the reboot that recovers it uncordons it; an
  application fault on another node never cordons.
* ``gpupipe produce --pod-metadata api`` (fake NVML and kubelet, real Kafka): samples carry the owner
  and labels of the pod holding the GPU, as the node-scoped watch learns them from the server, and a
  label changed on the server reaches later samples.

tests/integration/deploy/test_kube_rbac.py shows the same roles sufficient and minimal verb by verb.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.alerts.cordon import ANNOTATION_PREFIX
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.agent_harness import wait_for
from tests.conftest import REPO, free_port
from tests.fake_nvml import FakeNvml
from tests.integration.consumers.alerts.test_service import (
    AlertsProcess,
    TopicReader,
    _topics,
    produce,
    xid_event,
)
from tests.integration.deploy.test_helm_chart import helm, render  # noqa: F401 (helm: the session fixture)
from tests.integration.deploy.test_kube_rbac import NS, _node, _sa
from tests.kube_apiserver import KubeApiServer, start_kube_apiserver
from tests.kubelet_fake import FakeKubelet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

LOADED = "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiServer]:
    yield from start_kube_apiserver(tmp_path_factory.mktemp("kube"))


@pytest.fixture(scope="module")
def chart(helm: str, kube: KubeApiServer) -> dict[str, dict[str, Any]]:  # noqa: F811
    """The chart's ServiceAccounts and RBAC created on the server; returned by "Kind/name"."""
    docs = render(helm, None, "alerts.flags.dry-run=false")
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    rbac = [
        d
        for d in docs
        if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    ]
    kube.apply_all(rbac)
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in rbac}


def _loaded(host: str, ts: int, boot: str) -> dict[str, Any]:
    """The driver's load line: under a new boot id, the reboot that ends a fallen-off-the-bus alert."""
    return xid_event(
        host, "", None, ts, kind="driver_loaded", message=LOADED, driver_version="570.158.01",
        allocations=[], boot_id=boot, event_id=f"{host}|kmsg||driver_loaded|{ts}|{boot}",
    )  # fmt: skip


def _cordon_marks(kube: KubeApiServer, node: str) -> tuple[bool, dict[str, str]]:
    obj = _node(kube, node)
    ann = obj["metadata"].get("annotations") or {}
    ours = {k.removeprefix(ANNOTATION_PREFIX): v for k, v in ann.items() if k.startswith(ANNOTATION_PREFIX)}
    return bool(obj["spec"].get("unschedulable")), ours


def test_the_alerts_service_cordons_keeps_and_uncordons_through_the_real_server(
    kafka: str, topic_prefix: str, kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    broken, other = "gpu-broken", "gpu-app"
    for name in (broken, other, "gpu-idle-1", "gpu-idle-2"):  # four nodes: one cordon stays under half
        kube.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    token = kube.service_account_token(NS, _sa(chart, "alerts"), tmp_path / "alerts.token")
    t = _topics(kafka, topic_prefix)
    flags = [
        "--no-health-signals",  # no samples here: node-wide evidence ends what it mends at once
        "--update-interval", "1s",
        "--cordon", "--uncordon", "--cordon-max-per-hour", "10",
        "--kube-api-url", kube.url, "--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file),
    ]  # fmt: skip
    reader = TopicReader(kafka, t[topics.ALERTS])
    svc = AlertsProcess(kafka, topic_prefix, tmp_path, *flags).start()
    try:
        now = int(time.time() * 1000)
        fell = xid_event(broken, "0000:18:00", 79, now, message="GPU has fallen off the bus.", boot_id="A")
        app = xid_event(other, "0000:28:00", 13, now, pid=7, process_name="python3", boot_id="A")
        produce(kafka, t[topics.XID], "XidEvent", [fell, app])
        wait_for(lambda: _cordon_marks(kube, broken)[0], 30, "the broken node cordoned")
        alerts = {r["hostname"]: r for r in reader.latest().values()}
        assert alerts[broken]["drain_node"] and not alerts[other]["drain_node"]
        _, marks = _cordon_marks(kube, broken)
        assert marks["cordon-alert-id"] == alerts[broken]["alert_id"]
        assert marks["cordoned-by"].startswith("gpupipe-alerts/")

        # A restart (a rollout, an OOM kill): the GPU is still off the bus, the node stays cordoned.
        assert svc.stop() == 0
        svc = AlertsProcess(kafka, topic_prefix, tmp_path, *flags).start()
        again = xid_event(other, "0000:28:00", 13, now + 60_000, pid=7, process_name="python3", boot_id="A")
        produce(kafka, t[topics.XID], "XidEvent", [again])

        def folded() -> bool:  # the restarted service restored its alerts and handled input after them
            return any(r["hostname"] == other and r["occurrences"] == 2 for r in reader.poll())

        wait_for(folded, 30, "the restarted service's update of the application alert")
        assert _cordon_marks(kube, broken) == (True, marks)

        # The node reboots (the driver loads under a new boot id): recovered, uncordoned.
        produce(kafka, t[topics.XID], "XidEvent", [_loaded(broken, now + 120_000, "B")])
        wait_for(lambda: _cordon_marks(kube, broken) == (False, {}), 30, "the recovered node uncordoned")
        assert reader.latest()[alerts[broken]["alert_id"]]["resolve_reason"] == "recovered"
    finally:
        rc = svc.stop()
        reader.close()
    assert rc == 0
    assert _cordon_marks(kube, other) == (False, {})  # an application fault never cordons
    outcomes = [r["remediation"]["outcome"] for r in reader.records if r["status"] == "action"]
    # one cordon decision (the restart asked for nothing new); the others record boot evidence
    assert [o for o in outcomes if o != "recorded"] == ["cordoned"], outcomes


def _agent(kafka: str, prefix: str, tmp: Path, kubelet: str, token: Path, kube: KubeApiServer) -> Any:
    port = free_port()
    cmd = [
        sys.executable, str(REPO / "tests" / "fake_nvml_cli.py"), "produce", "--source", "nvml",
        "--interval", "200ms", "--bootstrap-servers", kafka, "--topic-prefix", prefix,
        "--kubelet-socket", kubelet, "--no-kmsg", "--spool-dir", str(tmp / "spool"),
        "--hostname", "gpu-meta", "--pod-metadata", "api", "--pod-labels", "team,project",
        "--kube-api-url", kube.url, "--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file),
        "--listen", f"127.0.0.1:{port}", "--log-format", "text",
    ]  # fmt: skip
    env = {**os.environ, "GPUPIPE_FAKE_NVML": "H100:8"}
    log = (tmp / "agent.log").open("wb")
    proc = hygiene.popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def up() -> bool:
        assert proc.poll() is None, (tmp / "agent.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(up, 60, "the agent's /healthz")
    return proc, log


def test_the_node_agent_labels_samples_from_the_real_servers_pods(
    kafka: str, topic_prefix: str, kube: KubeApiServer, chart: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    ns, labels = "vision", {"app": "train"}
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})  # fmt: skip
    spec = {"containers": [{"name": "main", "image": "busybox"}]}
    job = kube.create(
        f"/apis/batch/v1/namespaces/{ns}/jobs",
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "finetune"},
         "spec": {"manualSelector": True, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {**spec, "restartPolicy": "Never"}}}},
    )  # fmt: skip
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "finetune", "uid": job["metadata"]["uid"],
             "controller": True}  # fmt: skip
    kube.create(
        f"/api/v1/namespaces/{ns}/pods",
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "finetune-0", "labels": {**labels, "team": "vision"},
                      "ownerReferences": [owner]},
         "spec": {"nodeName": "gpu-meta", **spec}},
    )  # fmt: skip
    gpu = FakeNvml.node("H100", 8).gpus[2]  # what fake_nvml_cli builds for GPUPIPE_FAKE_NVML=H100:8
    device = {"resource_name": "nvidia.com/gpu", "device_ids": [gpu.uuid]}
    pod = {"name": "finetune-0", "namespace": ns, "containers": [{"name": "main", "devices": [device]}]}
    held = {"pod_resources": [pod]}
    token = kube.service_account_token(NS, _sa(chart, "producer"), tmp_path / "producer.token")
    codec = AvroCodec()
    samples = TopicSamples(kafka, topic_prefix, codec)
    with FakeKubelet(held, socket_path=str(tmp_path / "kubelet.sock")) as kubelet:
        proc, log = _agent(kafka, topic_prefix, tmp_path, kubelet.socket_path, token, kube)
        try:

            def alloc() -> dict[str, Any] | None:
                got = [s for s in samples.poll() if s["uuid"] == gpu.uuid and s["allocations"]]
                return got[-1]["allocations"][0] if got and got[-1]["allocations"][0]["owner_kind"] else None

            a = wait_for(alloc, 30, "a sample with the pod's metadata")
            got = (a["namespace"], a["pod"], a["owner_kind"], a["owner_name"])
            assert got == (ns, "finetune-0", "Job", "finetune")
            assert a["labels"] == {"team": "vision"} and a["metadata_status"] == "ok"
            kube.request("PATCH", f"/api/v1/namespaces/{ns}/pods/finetune-0",
                         {"metadata": {"labels": {"project": "llm"}}},
                         content_type="application/merge-patch+json")  # fmt: skip
            wait_for(lambda: (alloc() or {}).get("labels") == {"team": "vision", "project": "llm"}, 30,
                     "the label set on the server in a later sample")  # fmt: skip
        finally:
            rc = hygiene.stop_group(proc, timeout=30)
            log.close()
            samples.close()
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]


class TopicSamples:
    """GpuSample records of a topic from its beginning, decoded."""

    def __init__(self, kafka: str, prefix: str, codec: AvroCodec) -> None:
        ensure_topics(kafka, [topics.SAMPLES], prefix=prefix)
        topic = topics.with_prefix(prefix, topics.SAMPLES)
        self.codec = codec
        group = f"t-{time.time_ns()}"
        self.c = Consumer({"bootstrap.servers": kafka, "group.id": group, "enable.auto.commit": False})
        md = self.c.list_topics(topic, timeout=10).topics[topic]
        self.c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        for m in self.c.consume(1000, 0.2):
            if not m.error():
                self.records.append(self.codec.decode(m.value()).record)
        return self.records

    def close(self) -> None:
        self.c.close()
