"""Scale-out of `gpupipe metrics` against a real broker: instances of one group split the GPUs.

Two in-process instances share a consumer group while the simulated producer publishes 32 GPUs
(with frequent XIDs). Their /metrics together cover every GPU, no GPU (nor any GPU's XID
counter) is on both, and every GPU is on the instance holding its partition. Staleness is set to
5 minutes, so a GPU can only leave an instance through the drop at revocation. When one instance
stops, the other takes over every GPU.

A real Prometheus scrapes both with the shipped Kubernetes job (deploy/prometheus/kubernetes-sd.yml),
its pod discovery replaced by static targets that carry the same ``__meta_kubernetes_*`` labels
(Debian's Prometheus is built without Kubernetes discovery), plus a decoy pod the job must skip.

Also: our murmur2 matches librdkafka's partitioner, on which the XID ownership rests.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe.kafka.partitioner import key_partition
from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.meaning import sample_kafka_key
from tests.conftest import free_port
from tests.integration.metrics_helpers import (
    DEPLOY_KUBERNETES_SD,
    Prometheus,
    http_get,
    parse_exposition,
    prometheus_config,
    start_producer,
    wait_for,
)

pytestmark = pytest.mark.integration

NODES, GPUS_PER_NODE = 4, 8
SAMPLE_PARTITIONS = topics.DEFAULT_SPECS[topics.SAMPLES].partitions


def served(svc: MetricsService) -> tuple[set[str], set[str]]:
    """(GPU keys with sample series, GPU keys with an XID counter) on one instance's /metrics."""
    text = http_get(svc.url + "/metrics").decode()
    gpus, xids = set(), set()
    for name, labels, _ in parse_exposition(text):
        if "UUID" not in labels or not name.startswith("DCGM_"):
            continue
        key = labels["UUID"] + (f"/{labels['GPU_I_ID']}" if "GPU_I_ID" in labels else "")
        if name == "DCGM_EXP_XID_ERRORS_TOTAL":
            xids.add(key)
        elif name == "DCGM_FI_DEV_GPU_TEMP":
            gpus.add(key)
    return gpus, xids


def discovered_pod(port: int, name: str, app: str = "gpupipe-metrics") -> dict[str, Any]:
    """A static target labelled as Prometheus' Kubernetes pod discovery would label it."""
    return {
        "targets": [f"127.0.0.1:{port}"],
        "labels": {
            "__meta_kubernetes_namespace": "gpupipe",
            "__meta_kubernetes_pod_name": name,
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
            "__meta_kubernetes_pod_container_port_name": "metrics",
            "__meta_kubernetes_pod_phase": "Running",
        },
    }


def scalar(prom: Prometheus, expr: str) -> float | None:
    res = prom.query(expr)
    return float(res[0]["value"][1]) if res else None


def test_two_instances_split_gpus_then_one_takes_over(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    fleet = SimulatedFleet(FleetConfig(nodes=NODES, gpus_per_node=GPUS_PER_NODE)).tick(
        int(time.time() * 1000)
    )[0]
    expected = {r["uuid"] + (f"/{r['mig']['gpu_instance_id']}" if r["mig"] else "") for r in fleet}
    partition_of = {
        r["uuid"] + (f"/{r['mig']['gpu_instance_id']}" if r["mig"] else ""): key_partition(
            sample_kafka_key(r), SAMPLE_PARTITIONS
        )
        for r in fleet
    }
    producer = start_producer(
        kafka,
        topic_prefix,
        tmp_path / "producer.log",
        "--nodes",
        str(NODES),
        "--gpus-per-node",
        str(GPUS_PER_NODE),
        "--xid-rate",
        "1500",
    )
    port_a, port_b = free_port(), free_port()
    cfg = MetricsConfig(
        bootstrap=kafka,
        topic_prefix=topic_prefix,
        group_id=f"metrics-{uuid.uuid4().hex[:8]}",
        host="127.0.0.1",
        port=port_a,
        stale_after_s=300.0,  # only a revocation can take a GPU away
    )
    pods = [
        discovered_pod(port_a, "gpupipe-metrics-a"),
        discovered_pod(port_b, "gpupipe-metrics-b"),
        discovered_pod(free_port(), "some-other-app", app="other"),
    ]
    prom = Prometheus(
        prometheus_config(path=DEPLOY_KUBERNETES_SD, static_configs=pods), tmp_path / "prom", free_port()
    )
    a = MetricsService(cfg).start()
    b: MetricsService | None = None
    try:
        wait_for(lambda: served(a)[0] >= expected, 60, "instance A to serve all GPUs")
        assert a.handler.assigned == frozenset(range(SAMPLE_PARTITIONS))

        b = MetricsService(replace(cfg, port=port_b)).start()

        def split() -> bool:
            assert producer.alive(), producer.log_tail()
            pa, pb = a.handler.assigned, b.handler.assigned
            if not pa or not pb or pa & pb or pa | pb != frozenset(range(SAMPLE_PARTITIONS)):
                return False
            (ga, xa), (gb, xb) = served(a), served(b)
            return bool(ga and gb and ga | gb >= expected and xa and xb) and (ga, gb, xa, xb, pa, pb)

        ga, gb, xa, xb, pa, pb = wait_for(split, 60, "A and B to split partitions and GPUs")
        assert not ga & gb, f"GPUs on both instances: {ga & gb}"
        for key in expected:  # each GPU on the instance that holds its partition
            held = pa if key in ga else pb
            assert partition_of[key] in held, (key, partition_of[key], sorted(pa), sorted(pb))
        # XID counters follow their GPU's samples: never a GPU's counter on the other instance
        assert xa <= ga and xb <= gb, (xa - ga, xb - gb)
        assert a.handler.xid_results["other_owner"] > 0 and b.handler.xid_results["other_owner"] > 0

        # -- Prometheus scrapes both replicas: together they hold the fleet once -------------
        prom.wait_ready()
        fleet_q = 'count(DCGM_FI_DEV_GPU_TEMP{Hostname=~"sim-node-.*"})'
        wait_for(
            lambda: (
                scalar(prom, 'count(gpupipe_metrics_gpus{metrics_pod=~"gpupipe-metrics-(a|b)"} > 0)') == 2
                and scalar(prom, "sum(gpupipe_metrics_gpus)") == len(expected)
                and scalar(prom, fleet_q) == len(expected)
            ),
            30,
            "Prometheus to scrape both replicas",
        )
        assert len(prom.targets_up()) == 2, prom.targets_up()  # the decoy pod is not a target
        gpu_series = prom.query('DCGM_FI_DEV_GPU_TEMP{Hostname=~"sim-node-.*"}')
        assert all(
            s["metric"]["instance"] == s["metric"]["Hostname"] and "metrics_pod" not in s["metric"]
            for s in gpu_series
        ), gpu_series[:2]
        assert scalar(prom, "max(count by (UUID, GPU_I_ID, pod) (DCGM_FI_DEV_GPU_TEMP))") == 1.0

        b.stop()
        assert not b._loop_thread.is_alive()
        wait_for(
            lambda: a.handler.assigned == frozenset(range(SAMPLE_PARTITIONS)) and served(a)[0] >= expected,
            60,
            "A to take over every GPU after B left",
        )
        text = http_get(a.url + "/metrics").decode()
        revoked = [v for n, _, v in parse_exposition(text) if n == "gpupipe_metrics_revoked_gpus_total"]
        assert revoked and revoked[0] > 0, "A dropped the GPUs of the partitions it gave to B"
        wait_for(
            lambda: (
                scalar(prom, 'gpupipe_metrics_gpus{metrics_pod="gpupipe-metrics-a"}') == len(expected)
                and scalar(prom, fleet_q) == len(expected)
            ),
            30,
            "Prometheus to see every GPU on A",
        )
    except BaseException:
        print("--- producer log ---\n" + producer.log_tail())
        print("--- prometheus log ---\n" + prom.log_tail())
        raise
    finally:
        if b is not None:
            b.stop()
        a.stop()
        prom.stop()
        producer.stop()


def test_murmur2_matches_librdkafka_partitioner(kafka: str, topic_prefix: str) -> None:
    """Where the producer's murmur2_random partitioner puts a key is where key_partition says."""
    ensure_topics(kafka, [topics.SAMPLES, topics.XID], prefix=topic_prefix)
    rng = random.Random(7)
    keys = [f"GPU-{uuid.UUID(int=rng.getrandbits(128))}".encode() for _ in range(150)]
    keys += [f"MIG-{uuid.UUID(int=rng.getrandbits(128))}".encode() for _ in range(50)]
    keys += [b"a", b"ab", b"abc", b"abcd", b"abcde"]
    got: dict[tuple[str, bytes], int] = {}

    def done(err: object, msg: Any) -> None:
        assert err is None, err
        got[(msg.topic(), msg.key())] = msg.partition()

    p = Producer({"bootstrap.servers": kafka, "partitioner": "murmur2_random"})
    for base in (topics.SAMPLES, topics.XID):
        for k in keys:
            p.produce(topic_prefix + base, b"x", k, on_delivery=done)
    assert p.flush(20) == 0
    for base in (topics.SAMPLES, topics.XID):
        n = topics.DEFAULT_SPECS[base].partitions
        for k in keys:
            assert got[(topic_prefix + base, k)] == key_partition(k, n), (base, k)
