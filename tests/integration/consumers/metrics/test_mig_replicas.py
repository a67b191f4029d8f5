"""MIG GPUs on the shipped number of metrics replicas, on a real broker.

The node agent (fake NVML: four H100s in MIG mode, four slices each) publishes to Kafka; as many
`gpupipe metrics` instances as the shipped Deployment runs share a consumer group. A slice's
device-wide readings (temperature, power, clocks, energy) are its GPU's: whichever instance serves
the slice must have them, so every record of a physical GPU has to reach the same instance.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService
from gpupipe_producer.agent.node_agent import AgentConfig
from gpupipe_producer.publish import Publisher, producer_config
from tests.agent_harness import running_agent
from tests.conftest import REPO, free_port
from tests.fake_nvml import FakeGpu, FakeNvml
from tests.integration.metrics_helpers import http_get, parse_exposition, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = topics.DEFAULT_SPECS[topics.SAMPLES].partitions
#: Families a MIG instance takes from its GPU (dcgm-exporter reports them on every instance).
DEVICE_WIDE = (
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
)


def shipped_replicas() -> int:
    """The metrics replica count of the Kubernetes manifest, which the chart's default matches."""
    docs = yaml.safe_load_all((REPO / "deploy/kubernetes/consumers.yaml").read_text())
    (dep,) = [
        d for d in docs if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "gpupipe-metrics"
    ]
    values = yaml.safe_load((REPO / "deploy/helm/gpupipe/values.yaml").read_text())
    assert values["metrics"]["replicaCount"] == dep["spec"]["replicas"]
    return int(dep["spec"]["replicas"])


def mig_node() -> FakeNvml:
    gpus = []
    for i in range(4):
        g = FakeGpu(i, model="H100", uuid=f"GPU-6d1f0c3e-52d4-4b19-a6a0-3c5d9e7f2{i:03d}")
        g.enable_mig(["3g.40gb", "1g.10gb", "1g.10gb", "1g.10gb"])
        gpus.append(g)
    return FakeNvml(gpus)


def instance_series(svc: MetricsService) -> dict[str, set[str]]:
    """Per MIG instance (UUID/GPU_I_ID) served by ``svc``: the DCGM families it has."""
    out: dict[str, set[str]] = {}
    for name, labels, _ in parse_exposition(http_get(svc.url + "/metrics").decode()):
        if "GPU_I_ID" in labels and name.startswith("DCGM_FI_"):
            out.setdefault(f"{labels['UUID']}/{labels['GPU_I_ID']}", set()).add(name)
    return out


def test_every_mig_instance_has_its_gpus_readings_on_the_replica_serving_it(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    replicas = shipped_replicas()
    assert replicas >= 2
    ensure_topics(kafka, [topics.SAMPLES, topics.XID], prefix=topic_prefix)
    nvml = mig_node()
    slices = {f"{g.uuid}/{s.gpu_instance_id}" for g in nvml.gpus for s in g.mig_slices}
    assert len(slices) == 16
    cfg = MetricsConfig(
        bootstrap=kafka,
        topic_prefix=topic_prefix,
        group_id=f"metrics-{uuid.uuid4().hex[:8]}",
        host="127.0.0.1",
        port=free_port(),
        stale_after_s=300.0,  # only a revocation takes a GPU away
    )
    agent_cfg = AgentConfig(
        hostname="mig-node-1",
        interval_s=0.2,
        kubelet_timeout_s=0.3,
        kmsg_path=None,
        spool_dir=str(tmp_path / "spool"),
        resolve_pids=False,
    )
    services = [MetricsService(cfg if i == 0 else replace(cfg, port=free_port())) for i in range(replicas)]
    pub = Publisher(producer_config(kafka, linger_ms=5))
    try:
        for svc in services:
            svc.start()
        with running_agent(
            agent_cfg,
            pub,
            nvml,
            t_samples=topic_prefix + topics.SAMPLES,
            t_xid=topic_prefix + topics.XID,
        ):

            def split() -> dict[int, dict[str, set[str]]] | None:
                held = [svc.handler.assigned for svc in services]
                every = frozenset().union(*held)
                if (
                    not all(held)
                    or sum(map(len, held)) != PARTITIONS
                    or every != frozenset(range(PARTITIONS))
                ):
                    return None
                served = {i: instance_series(svc) for i, svc in enumerate(services)}
                seen = set().union(*(s.keys() for s in served.values()))
                return served if seen >= slices else None

            wait_for(split, 60, "the replicas to split the partitions and serve every MIG instance")

            def missing() -> list[str]:
                served = split()
                if served is None:
                    return ["the partitions moved"]
                return [
                    f"{key} on replica {i}: {sorted(set(DEVICE_WIDE) - names)}"
                    for i, per in served.items()
                    for key, names in per.items()
                    if not set(DEVICE_WIDE) <= names
                ]

            # A GPU's first sample may follow its slices' by a poll: await the readings, then
            # require them on every instance of every replica.
            wait_for(lambda: not missing(), 20, lambda: f"device-wide readings on every slice: {missing()}")
            served = split()
            assert served is not None
            assert sum(len(per) for per in served.values()) == len(slices), "a slice on two replicas"
    finally:
        for svc in services:
            svc.stop()
