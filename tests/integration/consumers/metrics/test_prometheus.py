"""`gpupipe metrics` end to end: real Kafka, the simulated producer, the CLI service, a real Prometheus.

Prometheus runs the shipped scrape job (deploy/prometheus/prometheus.yml: honor_labels, the node
name as ``instance``) at a 1 s interval. Through its HTTP API we run the panel queries of NVIDIA's
dcgm-exporter dashboard with its variables filled in as Grafana would ("All" and one concrete
value), then follow hand-made records: a pod that moves from one GPU to another, a pod that ends,
a GPU that stops reporting, an XID counted once. ``promtool check metrics`` lints the live output.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests.conftest import free_port
from tests.integration.metrics_helpers import (
    DEPLOY_PROMETHEUS,
    CraftedProducer,
    Prometheus,
    http_get,
    prometheus3,
    prometheus_config,
    promtool_check,
    start_metrics,
    start_producer,
    wait_for,
)
from tests.paths import TESTS

pytestmark = pytest.mark.integration

# NVIDIA's dashboard, copied as a fixture (source in tests/fixtures/metrics/dcgm-exporter/README.md)
DASHBOARD = TESTS / "fixtures" / "metrics" / "dcgm-exporter" / "dcgm-exporter-dashboard.json"

NODES, GPUS_PER_NODE = 2, 4


def dashboard_panels() -> tuple[list[str], list[dict[str, Any]]]:
    """(every panel ``expr`` in panel order, the templating variables) of NVIDIA's dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if isinstance(o.get("expr"), str):
                exprs.append(o["expr"])
            for k, v in o.items():
                if k != "templating":
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(doc.get("panels", doc))
    return exprs, doc["templating"]["list"]


_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m", "__interval_ms": "15000"}


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in values:
            return values[name]
        if name in BUILTINS:
            return BUILTINS[name]
        raise AssertionError(f"dashboard variable ${name} has no value in the test")

    return _VAR.sub(one, expr)


def variable_values(prom: Prometheus, templating: list[dict[str, Any]]) -> dict[str, list[str]]:
    """What Grafana would offer for each query variable: label_values(metric, label)."""
    out: dict[str, list[str]] = {}
    for var in templating:
        if var.get("type") != "query":
            continue
        m = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*(\w+)\s*\)\s*", var["query"])
        assert m, f"unexpected variable query {var['query']!r}"
        out[var["name"]] = prom.label_values(m.group(2), m.group(1))
    return out


def grafana_escape(value: str) -> str:
    """A value as Grafana's Prometheus data source puts it into a regex matcher: regex specials
    escaped with a backslash that is itself escaped for the PromQL string literal."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def grafana_all(values: list[str]) -> str:
    """Grafana's "All" for a multi-value variable without allValue: (v1|v2|...), values escaped."""
    return "(" + "|".join(grafana_escape(v) for v in values) + ")"


def uuids(result: list[dict[str, Any]]) -> set[str]:
    return {r["metric"].get("UUID", "") for r in result}


def crafted(template: dict[str, Any], uid: str, host: str, **kw: Any) -> dict[str, Any]:
    return {
        **template,
        "uuid": uid,
        "hostname": host,
        "mig": None,
        "processes": [],
        "timestamp_ms": int(time.time() * 1000),
        **kw,
    }


def alloc(ns: str, pod: str) -> dict[str, Any]:
    return {
        "namespace": ns,
        "pod": pod,
        "container": "main",
        "resource_name": "nvidia.com/gpu",
        "replica": None,
    }


@pytest.mark.parametrize("prometheus", ["2.42", "3"])
def test_dashboard_pods_staleness_and_xids_through_prometheus(
    kafka: str, topic_prefix: str, tmp_path: Path, prometheus: str
) -> None:
    port, prom_port = free_port(), free_port()
    metrics = start_metrics(kafka, topic_prefix, port, tmp_path / "metrics.log")
    producer = start_producer(
        kafka,
        topic_prefix,
        tmp_path / "producer.log",
        "--nodes",
        str(NODES),
        "--gpus-per-node",
        str(GPUS_PER_NODE),
    )
    binary = prometheus3()[0] if prometheus == "3" else None  # Debian's 2.42, or 3 from its Go module
    prom = Prometheus(prometheus_config([f"127.0.0.1:{port}"]), tmp_path / "prom", prom_port, binary=binary)
    try:
        sim = SimulatedFleet(FleetConfig(nodes=NODES, gpus_per_node=GPUS_PER_NODE)).tick(
            int(time.time() * 1000)
        )[0]
        sim_uuids = {r["uuid"] for r in sim}
        assert len(sim_uuids) == NODES * GPUS_PER_NODE
        prom.wait_ready()

        def all_sim_gpus() -> bool:
            assert metrics.alive(), f"metrics service exited:\n{metrics.log_tail()}"
            assert producer.alive(), f"producer exited:\n{producer.log_tail()}"
            return sim_uuids <= uuids(prom.query('DCGM_FI_DEV_GPU_TEMP{Hostname=~"sim-node-.*"}'))

        wait_for(all_sim_gpus, 60, "Prometheus to hold DCGM_FI_DEV_GPU_TEMP of every simulated GPU")

        # -- NVIDIA's dashboard: every panel query, variables as Grafana fills them ------------
        exprs, templating = dashboard_panels()
        assert len(exprs) == 8, exprs
        options = variable_values(prom, templating)
        assert {"sim-node-0000", "sim-node-0001"} <= set(options["instance"]), options  # nodes, not ports
        assert {str(i) for i in range(GPUS_PER_NODE)} <= set(options["gpu"]), options
        one = next(r for r in sim if r["hostname"] == "sim-node-0001" and r["gpu_index"] == 2)
        choices = {
            "All": {name: grafana_all(vals) for name, vals in options.items()},
            "one": {"instance": grafana_escape(one["hostname"]), "gpu": str(one["gpu_index"])},
        }
        for choice, values in choices.items():
            for expr in exprs:
                q = substitute(expr, values)
                result = prom.query(q)
                assert result, f"dashboard panel returned nothing ({choice}): {q}"
                for r in result:
                    v = float(r["value"][1])
                    assert v == v and abs(v) != float("inf"), (q, r)
                if expr.lstrip().startswith(("avg(", "sum(")):
                    assert len(result) == 1, (q, result)
                    assert float(result[0]["value"][1]) > 0, (q, result)
                elif choice == "All":
                    assert sim_uuids <= uuids(result), f"{q}: missing {sim_uuids - uuids(result)}"
                else:
                    assert uuids(result) == {one["uuid"]}, (q, result)
                if "SM_CLOCK" in expr:
                    assert all(float(r["value"][1]) >= 1e8 for r in result), result  # MHz x 1e6 = Hz
                if "TENSOR_ACTIVE" in expr:
                    assert all(0.0 <= float(r["value"][1]) <= 1.0 for r in result), result

        # -- a pod moves, then ends; a GPU goes quiet; an XID is counted once --------------------
        samples_topic = topic_prefix + "gpu.samples.v1"
        xid_topic = topic_prefix + "gpu.xid.v1"
        tag = uuid.uuid4().hex[:8]
        host, pod, ns = f"crafted-{tag}", f"mover-{tag}", "ns-move"
        gx, gy, gz = (f"GPU-{tag}-{c}" for c in "xyz")
        tmpl = sim[0]
        out = CraftedProducer(kafka)

        def publish(x_allocs: list[dict], y_allocs: list[dict]) -> None:
            # 60 s interval: these GPUs stay (3 x 60 s) while the test runs without new samples.
            out.sample(
                samples_topic, crafted(tmpl, gx, host, gpu_index=0, interval_ms=60_000, allocations=x_allocs)
            )
            out.sample(
                samples_topic, crafted(tmpl, gy, host, gpu_index=1, interval_ms=60_000, allocations=y_allocs)
            )
            out.flush()

        by_pod = f'DCGM_FI_DEV_GPU_UTIL{{pod="{pod}"}}'
        publish([alloc(ns, pod)], [])
        res = wait_for(lambda: prom.query(by_pod), 20, f"{pod} on {gx}")
        assert uuids(res) == {gx} and res[0]["metric"]["namespace"] == ns, res
        assert res[0]["metric"]["instance"] == host, res  # the node name, from metric_relabel_configs

        publish([], [alloc(ns, pod)])
        wait_for(lambda: uuids(prom.query(by_pod)) == {gy}, 20, f"{pod} to move to {gy}")

        publish([], [])  # the pod ended
        wait_for(lambda: prom.query(by_pod) == [], 20, f"series of ended pod {pod} to vanish")
        both = prom.query(f'DCGM_FI_DEV_GPU_UTIL{{UUID=~"{gx}|{gy}"}}')
        assert uuids(both) == {gx, gy} and all("pod" not in r["metric"] for r in both), both

        # a GPU that stops reporting goes after 3 of its 1 s intervals
        out.sample(samples_topic, crafted(tmpl, gz, host, gpu_index=2, interval_ms=1000, allocations=[]))
        out.flush()
        by_z = f'DCGM_FI_DEV_POWER_USAGE{{UUID="{gz}"}}'
        wait_for(lambda: prom.query(by_z), 20, f"{gz} to appear")
        wait_for(lambda: prom.query(by_z) == [], 20, f"quiet {gz} to vanish")

        # XID 79 on gx, sent twice with one event id: counted once, shown as the last XID
        ev = {
            "event_id": f"test/{tag}/79",
            "timestamp_ms": int(time.time() * 1000),
            "hostname": host,
            "kind": "xid",
            "xid": 79,
            "pci_bus_id": tmpl["pci_bus_id"],
            "gpu_index": 0,
            "uuid": gx,
            "model_name": tmpl["model_name"],
            "driver_version": tmpl["driver_version"],
            "pid": None,
            "process_name": None,
            "message": "GPU has fallen off the bus.",
            "gpu_instance_id": None,
            "compute_instance_id": None,
            "mig_uuid": None,
            "source": "nvml",
            "allocations": [],
        }
        out.xid(xid_topic, ev)
        out.xid(xid_topic, ev)
        out.flush()
        total = f'DCGM_EXP_XID_ERRORS_TOTAL{{UUID="{gx}",xid="79"}}'
        res = wait_for(lambda: prom.query(total), 20, "the XID counter")
        assert float(res[0]["value"][1]) == 1.0, res
        last = prom.query(f'DCGM_FI_DEV_XID_ERRORS{{UUID="{gx}"}}')
        assert [float(r["value"][1]) for r in last] == [79.0], last

        # -- the service's own metrics, in Prometheus ------------------------------------------
        assert prom.query('up{job="gpupipe-metrics"} == 1'), prom.targets_up()
        assert prom.query(f'gpupipe_consumer_lag_records{{topic="{samples_topic}"}}')
        ages = prom.query('gpupipe_sample_age_seconds{Hostname=~"sim-node-.*"}')
        assert sim_uuids <= uuids(ages) and all(float(a["value"][1]) < 30 for a in ages), ages
        assert prom.query('gpupipe_metrics_render_seconds_count{stage="gzip"} > 0'), (
            "Prometheus asks for gzip"
        )
        assert prom.query("gpupipe_metrics_expired_total >= 1")
        assert prom.query("gpupipe_consumer_records_total > 0")

        # -- promtool on the live exposition -----------------------------------------------------
        text = http_get(f"http://127.0.0.1:{port}/metrics")
        assert promtool_check(text) == []
        health = json.loads(http_get(f"http://127.0.0.1:{port}/healthz"))
        assert health["status"] == "ok" and health["gpus"] >= len(sim_uuids) + 2, health
    except BaseException:
        print("--- metrics log ---\n" + metrics.log_tail())
        print("--- producer log ---\n" + producer.log_tail())
        print("--- prometheus log ---\n" + prom.log_tail())
        raise
    finally:
        prom.stop()
        producer.stop()
        rc = metrics.stop()
    assert rc == 0, f"metrics exited {rc} on SIGTERM:\n{metrics.log_tail()}"


def test_shipped_compose_config_passes_promtool() -> None:
    """deploy/prometheus/prometheus.yml as shipped (the Kubernetes job cannot be checked this way:
    Debian's Prometheus is built without Kubernetes discovery; test_metrics_scale_out runs it)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package 'prometheus'"
    proc = subprocess.run(
        [promtool, "check", "config", str(DEPLOY_PROMETHEUS)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
