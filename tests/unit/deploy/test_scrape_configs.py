"""The shipped Kubernetes scrape config reaches every workload of deploy/kubernetes that serves /metrics.

Found while adding the recommendations row to the dashboards: kubernetes-sd.yml scraped only the
metrics and recommend Deployments, so in a cluster set up from deploy/ the Chargeback dashboard (fed
by chargeback's own counters) and every service's health and lag series were never scraped.
"""

from __future__ import annotations

import re

import yaml

from tests.paths import REPO

REPO = REPO
SD = REPO / "deploy" / "prometheus" / "kubernetes-sd.yml"


def _workloads_with_metrics_port() -> set[str]:
    names: set[str] = set()
    for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet"):
                continue
            pod = doc["spec"]["template"]
            ports = {p.get("name") for c in pod["spec"]["containers"] for p in c.get("ports") or ()}
            if "metrics" in ports:
                names.add(pod["metadata"]["labels"]["app.kubernetes.io/name"])
    return names


def _kept_names(job: dict) -> str:
    for rule in job.get("relabel_configs") or ():
        if rule.get("source_labels") == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]:
            assert rule.get("action") == "keep"
            return str(rule["regex"])
    raise AssertionError(f"{job['job_name']} selects no app.kubernetes.io/name")


def test_every_workload_with_a_metrics_port_is_scraped_with_its_own_labels() -> None:
    jobs = yaml.safe_load(SD.read_text())["scrape_configs"]
    workloads = _workloads_with_metrics_port()
    assert {
        "gpupipe-metrics",
        "gpupipe-chargeback",
        "gpupipe-alerts",
        "gpupipe-recommend",
        "gpupipe-producer",
    } <= (workloads)
    for name in sorted(workloads):
        scraping = [j for j in jobs if re.fullmatch(_kept_names(j), name)]
        assert len(scraping) == 1, (name, [j["job_name"] for j in scraping])
        # their namespace/pod labels name the GPU's workload or the billed namespace, not the target
        assert scraping[0].get("honor_labels") is True, scraping[0]["job_name"]
