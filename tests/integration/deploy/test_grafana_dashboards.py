"""The Grafana dashboards against the simulated pipeline and a real Prometheus.

A real broker, the simulated producer (a fleet with MIG and time-sliced GPUs and frequent XIDs),
the metrics, chargeback (10 s windows), alerts and recommend (idle after 5 s, so the simulator's
idle notebooks are recommended within seconds) services, and the Debian Prometheus scraping them
every second or two with the shipped scrape jobs and alerting rules. Then, as Grafana would send
them: every template variable query returns values, and every panel query of the three dashboards
(variables at their "All" value) returns data. Finally the Chargeback dashboard's cost total
matches `gpupipe report chargeback`'s over the same committed windows within 1%.

Every naming generation: a second `gpupipe metrics --dialect dcgm-4.10` reads the same samples,
and a second pair of servers (2.42 and 3) scrapes it instead of the default one, with the same
other jobs and rules. There too every variable and panel has data, every rule is healthy, each
read of a renamed field in a rule finds the GPUs it finds under the default, and GpuMetricsAbsent
stays quiet (it fired there while the rules read 4.8's names only).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka.admin import AdminClient

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.metrics import dialect
from gpupipe_consumers.metrics.dialect_promql import renamed_reads
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.command import read_chargeback_records
from gpupipe_schemas.codec import AvroCodec
from tests.conftest import free_port
from tests.integration.metrics_helpers import (
    DEPLOY_PROMETHEUS,
    SCRAPE_PROTOCOLS,
    Proc,
    Prometheus,
    http_get,
    prometheus3,
    prometheus_config,
    start_producer,
    wait_for,
)
from tests.paths import REPO

pytestmark = pytest.mark.integration

REPO = REPO
DASHBOARDS = REPO / "deploy" / "grafana" / "dashboards"
RULES = REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.yml"
FAULT_RULES = REPO / "deploy" / "prometheus" / "gpupipe-faults.rules.yml"
NEWEST = dialect.GENERATIONS[-1]  # the second world's --dialect (dcgm-4.10)
ALL = ".*"  # every "All" of our dashboards' variables (allValue)
TEAMS = {"teams": [{"namespace": "inference-*", "team": "serving"}, {"namespace": "llm-*", "team": "ml"}]}


_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
BUILTINS = {"__rate_interval": "15s", "__interval": "5s", "__range": "5m"}


def substitute(expr: str, values: dict[str, str]) -> str:
    """A query as Grafana sends it: dashboard variables and Grafana's own ($__range, ...) replaced."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in values:
            return values[name]
        if name in BUILTINS:
            return BUILTINS[name]
        raise AssertionError(f"dashboard variable ${name} has no value in the test")

    return _VAR.sub(one, expr)


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in doc["panels"]:
        out += [p, *p.get("panels", [])]
    return [p for p in out if p.get("targets")]


def test_dashboards_are_built_from_code_and_shipped_in_the_chart() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "grafana" / "build_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in DASHBOARDS.glob("*.json"))
    assert names == ["chargeback.json", "fleet.json", "gpu-health.json"]
    uids = set()
    for name in names:
        doc = json.loads((DASHBOARDS / name).read_text())
        uids.add(doc["uid"])
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids)) and 0 not in ids, name
        assert all(t["refId"] for p in panels(doc) for t in p["targets"])
        assert all(t["datasource"]["uid"] == "${datasource}" for p in panels(doc) for t in p["targets"])
    assert len(uids) == 3


def shipped_job(name: str, targets: list[str], interval: str) -> dict[str, Any]:
    """A scrape job of deploy/prometheus/prometheus.yml as shipped, with the test's targets."""
    (job,) = [
        j for j in yaml.safe_load(DEPLOY_PROMETHEUS.read_text())["scrape_configs"] if j["job_name"] == name
    ]
    return {
        **job,
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "static_configs": [{"targets": targets}],
    }


def _query_at(prom: Prometheus, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    doc = json.loads(http_get(f"{prom.url}/api/v1/query?{urllib.parse.urlencode(params)}"))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _variable_values(prom: Prometheus, var: dict[str, Any], values: dict[str, str]) -> list[str]:
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", var["query"])
    assert m, f"unexpected variable query {var['query']!r}"
    return prom.label_values(m.group(2), substitute(m.group(1), values))


def world_config(metrics: str, ports: dict[str, int]) -> dict[str, Any]:
    """The shipped jobs and both rule files, the GPU job scraping the metrics service at ``metrics``."""
    cfg = prometheus_config([metrics])
    cfg["scrape_configs"].append(
        {
            "job_name": "gpupipe-services",
            # Slower than the GPU job: on a loaded 2-core machine a busy service can take over 1 s to
            # answer, and a failed scrape makes its series stale.
            "scrape_interval": "2s",
            "scrape_timeout": "2s",
            "static_configs": [
                {"targets": [f"127.0.0.1:{ports[s]}" for s in ("producer", "chargeback", "alerts")]}
            ],
        }
    )
    cfg["scrape_configs"].append(shipped_job("gpupipe-recommend", [f"127.0.0.1:{ports['recommend']}"], "2s"))
    cfg["rule_files"] = [str(RULES), str(FAULT_RULES)]
    return cfg


@pytest.fixture
def pipeline(kafka: str, topic_prefix: str, tmp_path: Path):
    names = ("producer", "metrics", "metrics_newest", "chargeback", "alerts", "recommend", "prometheus")
    ports = {name: free_port() for name in names}
    cfg = world_config(f"127.0.0.1:{ports['metrics']}", ports)
    prom = Prometheus(cfg, tmp_path / "prom", ports["prometheus"])
    # Prometheus 3 beside it, with the same jobs and rules, and one more job per service and scrape
    # protocol that accepts that protocol only (Prometheus 3 refuses a response of another type)
    cfg3 = copy.deepcopy(cfg)
    for name in ("metrics", "producer", "chargeback", "alerts", "recommend"):
        for proto in SCRAPE_PROTOCOLS:
            cfg3["scrape_configs"].append(
                {
                    "job_name": f"{name}-{proto}",
                    "scrape_interval": "2s",
                    "scrape_timeout": "2s",
                    "scrape_protocols": [proto],
                    "static_configs": [{"targets": [f"127.0.0.1:{ports[name]}"]}],
                }
            )
    server3, _ = prometheus3()
    prom3 = Prometheus(cfg3, tmp_path / "prom3", free_port(), binary=server3)
    # the newest generation's world: the same jobs and rules, the GPU job on the other metrics service
    cfg_newest = world_config(f"127.0.0.1:{ports['metrics_newest']}", ports)
    newest = (
        Prometheus(cfg_newest, tmp_path / "prom-newest", free_port()),
        Prometheus(cfg_newest, tmp_path / "prom3-newest", free_port(), binary=server3),
    )
    teams = tmp_path / "teams.yaml"
    teams.write_text(yaml.safe_dump(TEAMS))
    common = ["--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
    # Topics first, with leaders elected: services that create them concurrently can meet
    # "not leader for partition" while the broker settles.
    ensure_topics(kafka, topics.ALL, prefix=topic_prefix)
    admin = AdminClient({"bootstrap.servers": kafka})

    def leaders() -> bool:
        md = admin.list_topics(timeout=10).topics
        names = [topics.with_prefix(topic_prefix, t) for t in topics.ALL]
        return all(n in md and all(p.leader >= 0 for p in md[n].partitions.values()) for n in names)

    wait_for(leaders, 30, "partition leaders of the new topics")
    procs = {
        "chargeback": Proc(
            [
                "chargeback",
                *common,
                "--listen",
                f"127.0.0.1:{ports['chargeback']}",
                "--window",
                "10s",
                "--grace",
                "2s",
                "--prices",
                str(REPO / "deploy" / "prices.example.yaml"),
                "--teams",
                str(teams),
            ],
            tmp_path / "chargeback.log",
        ),
        "metrics": Proc(
            ["metrics", *common, "--listen", f"127.0.0.1:{ports['metrics']}"],
            tmp_path / "metrics.log",
        ),
        "metrics_newest": Proc(
            [
                "metrics",
                *common,
                "--listen",
                f"127.0.0.1:{ports['metrics_newest']}",
                "--dialect",
                NEWEST,
                "--group-id",
                f"{topic_prefix}metrics-newest",
            ],
            tmp_path / "metrics-newest.log",
        ),
        "alerts": Proc(
            ["alerts", *common, "--listen", f"127.0.0.1:{ports['alerts']}"],
            tmp_path / "alerts.log",
        ),
        # As scripts/demo.py: a short --idle-after, so that the notebooks the simulator starts idle
        # are recommended within seconds (from the oldest sample: none is missed while it joins).
        "recommend": Proc(
            [
                "recommend",
                *common,
                "--listen",
                f"127.0.0.1:{ports['recommend']}",
                "--idle-after",
                "5s",
                "--update-interval",
                "5s",
                "--from-beginning",
                "--group-id",
                f"rec-{topic_prefix}",
                "--prices",
                str(REPO / "deploy" / "prices.example.yaml"),
                "--teams",
                str(teams),
            ],
            tmp_path / "recommend.log",
        ),
    }
    procs["producer"] = start_producer(
        kafka,
        topic_prefix,
        tmp_path / "producer.log",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--seed",
        "8",  # a fleet with MIG slices, time-sliced GPUs and idle notebooks from the start
        "--xid-rate",
        "900",
        "--listen",
        f"127.0.0.1:{ports['producer']}",
    )
    servers = {"2.42": prom, "3": prom3, f"2.42 {NEWEST}": newest[0], f"3 {NEWEST}": newest[1]}
    try:
        for server in servers.values():
            server.wait_ready()
        yield prom, procs, ports, prom3, newest
    finally:
        for p in procs.values():
            p.stop()
        for server in servers.values():
            server.stop()
        for name, p in procs.items():
            print(f"--- {name} log ---\n{p.log_tail(1500)}")
        for name, server in servers.items():
            print(f"--- prometheus {name} log ---\n" + server.log_tail(1500))


def test_every_panel_and_variable_has_data(kafka: str, topic_prefix: str, pipeline) -> None:
    prom, procs, ports, prom3, newest = pipeline
    docs = {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}
    values = {"datasource": "prometheus"}
    for doc in docs.values():
        for var in doc["templating"]["list"]:
            if var["type"] == "query":
                values[var["name"]] = ALL if var.get("includeAll") else ""
    queries = [
        (f"{name}: {p['title']} [{t['refId']}]", substitute(t["expr"], values))
        for name, doc in docs.items()
        for p in panels(doc)
        for t in p["targets"]
    ]
    assert len(queries) >= 40

    def empty(server: Prometheus) -> list[str]:
        for name, p in procs.items():
            assert p.alive(), f"{name} exited:\n{p.log_tail()}"
        return [title for title, expr in queries if not _query_at(server, expr)]

    # Debian's 2.42, then Prometheus 3 with the same jobs and rules; then both with the GPU series
    # of --dialect dcgm-4.10 alone
    for server in (prom, prom3, *newest):
        missing: list[str] = []

        def all_have_data(server: Prometheus = server, missing: list[str] = missing) -> bool:
            missing[:] = empty(server)
            return not missing

        def why(server: Prometheus = server, missing: list[str] = missing) -> str:
            still = [(t, e) for t, e in queries if t in missing]
            return f"data in every panel of {server.url}; still empty: {still}"

        wait_for(all_have_data, 120, why, interval_s=2)
    # Prometheus 3: every service in every scrape protocol, and the shipped rules loaded and healthy
    services = ("metrics", "producer", "chargeback", "alerts", "recommend")
    protocol_jobs = {f"{n}-{p}" for n in services for p in SCRAPE_PROTOCOLS}

    def protocols_up() -> set[str]:
        up = {r["metric"]["job"] for r in _query_at(prom3, "up == 1")}
        return protocol_jobs - up

    wait_for(
        lambda: not protocols_up(),
        60,
        lambda: f"Prometheus 3 scraping in every protocol; down: {protocols_up()}",
    )
    scraped = {r["metric"]["job"]: float(r["value"][1]) for r in _query_at(prom3, "scrape_samples_scraped")}
    assert all(scraped[j] > 0 for j in protocol_jobs), scraped
    for server in (prom, prom3, *newest):
        rules = json.loads(http_get(f"{server.url}/api/v1/rules"))["data"]["groups"]
        assert rules and all(r["health"] == "ok" for g in rules for r in g["rules"]), (server.url, rules)
    check_rules_read_the_newest_names(prom, newest)

    for name, doc in docs.items():
        for var in doc["templating"]["list"]:
            if var["type"] == "query":
                for server in (prom, newest[0]):
                    got = _variable_values(server, var, values)
                    assert got, f"{name}: variable ${var['name']} offers nothing on {server.url}"
    team_var = next(v for v in docs["chargeback"]["templating"]["list"] if v["name"] == "team")
    assert {"serving", "ml", "__unallocated__"} <= set(_variable_values(prom, team_var, values))
    # MIG slices and time-sliced GPUs are in the fleet's panels.
    assert _query_at(prom, 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{GPU_I_PROFILE!=""}')
    assert _query_at(newest[0], 'DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO{GPU_I_PROFILE!=""}')
    assert _query_at(prom, "count by (UUID) (gpupipe_pod_gpu_util_percent) > 1")  # per-pod shares
    # Every recommendation's team is one the Chargeback dashboard's $team offers (chargeback's).
    assert not _query_at(
        prom,
        "gpupipe_recommendation_cost_wasted unless on (team) group by (team) (gpupipe_chargeback_cost_total)",
    )
    assert {"release", "right_size_mig", "shared_gpu", "cheaper_model"} >= {
        r["metric"]["action"] for r in _query_at(prom, "gpupipe_recommendation_idle_seconds")
    }

    # The Chargeback dashboard's total equals the report's, over the same committed windows.
    topic = topics.with_prefix(topic_prefix, topics.CHARGEBACK)

    def windows() -> int:
        return len({r["window_start_ms"] for r in read_chargeback_records(kafka, topic, AvroCodec())}) >= 3

    wait_for(windows, 60, "three chargeback windows committed", interval_s=2)
    procs["producer"].stop()
    cost_stat = next(p for p in docs["chargeback"]["panels"] if p.get("title") == "Cost")
    expr = substitute(cost_stat["targets"][0]["expr"], {**values, "__range": "1h"})

    cb_metrics = f"http://127.0.0.1:{ports['chargeback']}/metrics"
    seen: dict[str, Any] = {}

    def committed_by_service() -> float:
        """The service's own count of committed records, read from it directly (not via a scrape)."""
        text = http_get(cb_metrics).decode()
        rows = re.findall(r"^gpupipe_chargeback_records_emitted_total\{[^}]*\} (\S+)$", text, re.M)
        return sum(float(v) for v in rows)

    def scraped_after(t: float) -> float | None:
        """The time of a Prometheus scrape of chargeback that began after ``t``, once there is one."""
        newest = _query_at(prom, "max(timestamp(gpupipe_chargeback_cost_total))")
        at = float(newest[0]["value"][1]) if newest else 0.0
        return at if at > t else None

    def settled() -> tuple[float, float] | None:
        records = read_chargeback_records(kafka, topic, AvroCodec(), timeout_s=30)
        service = committed_by_service()
        seen.update(records=len(records), service=service)
        if not records or service != len(records):
            return None  # windows are still being committed
        since = time.time()
        at = wait_for(lambda: scraped_after(since), 30, "a scrape of chargeback", interval_s=0.5)
        scraped = _query_at(prom, "sum(gpupipe_chargeback_records_emitted_total)", at)
        seen.update(scraped=scraped, at=at)
        if not scraped or float(scraped[0]["value"][1]) != len(records):
            return None  # something was committed in between: look again
        if len(read_chargeback_records(kafka, topic, AvroCodec(), timeout_s=30)) != len(records):
            return None
        dashboard = float(_query_at(prom, expr, at)[0]["value"][1])
        report = sum(r.cost for r in build_report(records, period="all"))
        return dashboard, report

    dashboard, report = wait_for(
        settled, 90, lambda: f"chargeback to settle after the producer stopped ({seen})", interval_s=1
    )
    print(f"chargeback cost: dashboard {dashboard:.6f}, report {report:.6f}")
    assert report > 0
    assert dashboard == pytest.approx(report, rel=0.01)


def _uuids(server: Prometheus, expr: str) -> set[str]:
    return {r["metric"].get("UUID", "") for r in _query_at(server, expr)}


def check_rules_read_the_newest_names(default: Prometheus, newest: tuple[Prometheus, ...]) -> None:
    """The servers of ``newest`` see the 4.10 names alone; there each read of a renamed field in a
    rule finds the GPUs it finds on ``default`` (``absent``: nothing, in both), and GpuMetricsAbsent
    is neither pending nor firing once the rules have been evaluated on scraped series."""
    assert not _query_at(newest[0], "DCGM_FI_DEV_GPU_TEMP") and _query_at(
        newest[0], "DCGM_FI_DEV_GPU_TEMP_CELSIUS"
    )
    rules = [
        r for f in (RULES, FAULT_RULES) for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
    ]
    reads = {q: r["alert"] for r in rules for q in renamed_reads(r["expr"])}
    assert len(reads) >= 6, reads  # distinct reads of the rules, each named by one rule reading it
    for q, alert in reads.items():
        want = _uuids(default, q)
        assert (want == set()) == q.startswith("(absent("), (alert, q, want)
        for server in newest:
            got = _uuids(server, q)
            assert got == want, f"{alert}: {q} on {server.url}: {sorted(got ^ want)[:5]} differ"

    def absent_quiet() -> bool:
        return all(not _query_at(s, 'ALERTS{alertname="GpuMetricsAbsent"}') for s in newest)

    wait_for(absent_quiet, 30, f"GpuMetricsAbsent to stay quiet under --dialect {NEWEST}", interval_s=1)


def test_compose_provisions_grafana_with_the_dashboards() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = {v.split(":")[0]: v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/gpupipe.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    ds = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    res = subprocess.run(
        ["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config", "-q"], timeout=60
    )
    assert res.returncode == 0
