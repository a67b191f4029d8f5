"""Idle-GPU recommendations end to end: simulated fleet -> Kafka -> `gpupipe recommend` -> report idle.

Six simulated hours of 4 nodes x 4 GPUs at one sample a minute (5,760 samples, seed 1). The expected
recommendations are computed from the simulator's own ground truth (which pods held which GPU, and
when), not from the detector: every notebook that held its GPU for at least --idle-after (2 h) and
nothing else; a pod still holding its GPU at the end reports its waste as of its last update
(fired at since + 2 h, then every 15 min).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpupipe.domain.prices import load_price_table
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.report.carbon import load_carbon_config
from gpupipe_consumers.report.workload_report import build_workload_report
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests.conftest import free_port
from tests.integration.chargeback_util import Progress, past_hour_ms, start_service, stop_service
from tests.integration.consumers.alerts.test_service import Alertmanager, wait_until
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe

pytestmark = pytest.mark.integration

NODES, GPUS, INTERVAL_MS, SEED, HOURS, HPC_NODES = 4, 4, 60_000, 1, 6, 1
IDLE_AFTER_MS, UPDATE_MS = 2 * 3_600_000, 900_000
PRICES = REPO / "deploy" / "prices.example.yaml"


def fleet_config() -> FleetConfig:
    return FleetConfig(
        nodes=NODES,
        gpus_per_node=GPUS,
        interval_ms=INTERVAL_MS,
        seed=SEED,
        xid_rate_per_gpu_hour=0,
        hpc_nodes=HPC_NODES,
    )


def ground_truth(start_ms: int) -> tuple[dict[tuple[str, str], dict[str, Any]], set[str]]:
    """Per (namespace, pod): first and last sample holding a GPU, model, fraction; and the busy kinds seen."""
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=NODES, gpus_per_node=GPUS, interval_ms=INTERVAL_MS, seed=SEED, xid_rate_per_gpu_hour=0
        )
    )
    held: dict[tuple[str, str], dict[str, Any]] = {}
    for i in range(HOURS * 3_600_000 // INTERVAL_MS):
        ts = start_ms + i * INTERVAL_MS
        samples, _ = fleet.tick(ts)
        for s in samples:
            for a in s["allocations"]:
                h = held.setdefault(
                    (a["namespace"], a["pod"]),
                    {
                        "first": ts,
                        "model": s["model_name"],
                        "mig": s["mig"],
                        "alloc": a,
                        "n": len(s["allocations"]),
                    },
                )
                h["last"] = ts
    return held, {p.split("-")[0] for ns, p in held if ns != "hpc"}


def expected(start_ms: int) -> dict[str, dict[str, Any]]:
    held, kinds = ground_truth(start_ms)
    assert {"train", "serve", "notebook"} <= kinds  # busy pods were there to be (not) reported
    end_ms = start_ms + HOURS * 3_600_000
    prices = load_price_table(PRICES)
    out = {}
    for (ns, pod), h in held.items():
        span = h["last"] - h["first"] + INTERVAL_MS
        if not pod.startswith("notebook-") or span < IDLE_AFTER_MS:
            continue
        if h["last"] + INTERVAL_MS < end_ms:  # ended: resolved with its whole span
            idle_ms, status = span, "resolved"
        else:  # still held: the last revision is the last update
            fired = h["first"] + IDLE_AFTER_MS - INTERVAL_MS
            last_update = fired + (h["last"] - fired) // UPDATE_MS * UPDATE_MS
            idle_ms, status = last_update - h["first"] + INTERVAL_MS, "firing"
        fraction = h["mig"]["slice_fraction"] if h["mig"] else 1.0 / h["n"]
        hours = idle_ms / 3_600_000 * fraction
        out[pod] = {
            "namespace": ns,
            "status": status,
            "gpu_hours": hours,
            "cost": hours * prices.gpu_price(h["model"]).per_gpu_hour,
            "owner": f"{ns}/{h['alloc']['owner_kind']}/{h['alloc']['owner_name']}",
            "team": h["alloc"]["labels"]["team"],
        }
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def fleet(kafka: str) -> dict[str, Any]:
    """The simulated fleet (with one HPC node) produced once for this module's tests."""
    prefix = f"recfleet-{free_port()}."
    start_ms = past_hour_ms(HOURS + 1)
    start_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_ms / 1000))
    common = ["--bootstrap-servers", kafka, "--topic-prefix", prefix, "--log-format", "text"]
    p = gpupipe(
        "produce", "--source", "simulated", "--nodes", str(NODES), "--gpus-per-node", str(GPUS),
        "--hpc-nodes", str(HPC_NODES), "--interval", "60s", "--duration", f"{HOURS}h", "--start-time",
        start_iso, "--speed", "max", "--seed", str(SEED), "--xid-rate", "0", "--log-level", "warning",
        *common,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return {"prefix": prefix, "start_ms": start_ms, "common": common}


def test_idle_notebooks_and_nothing_else(kafka: str, fleet: dict[str, Any], tmp_path: Path) -> None:
    start_ms, common, topic_prefix = fleet["start_ms"], fleet["common"], fleet["prefix"]
    want = expected(start_ms)
    assert len(want) == 4 and {w["status"] for w in want.values()} == {"firing", "resolved"}
    port = free_port()
    am = Alertmanager(tmp_path).start()
    log = open(tmp_path / "recommend.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [*GPUPIPE, "recommend", "--from-beginning", "--prices", str(PRICES), "--listen", f"127.0.0.1:{port}",
         "--group-id", f"rec-{topic_prefix}", "--alertmanager-url", am.url, *common],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "recommend.log").read_text()[-3000:]
            try:
                text = scrape(port)
            except OSError:
                text = ""
            if metric(text, "gpupipe_consumer_records_total") >= (NODES + HPC_NODES) * GPUS * HOURS * 60:
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.2)
        # Open recommendations are Prometheus series, one per idle pod and GPU.
        firing = {k: w for k, w in want.items() if w["status"] == "firing"}
        assert metric(text, "gpupipe_recommendations_open") == len(firing)
        for pod, w in firing.items():
            assert metric(
                text, "gpupipe_recommendation_cost_wasted", pod=pod, owner=w["owner"].split("/", 1)[1]
            ) == (pytest.approx(w["cost"], rel=1e-9))
        assert not re.search(r'gpupipe_recommendation_idle_seconds\{[^}]*pod="(train|serve|batch)-', text)
        # Optionally Alertmanager, at severity info: the open ones are active there.
        active = wait_until(
            lambda: {a["labels"]["pod"] for a in am.alerts()} == set(firing) and am.alerts(), 20, "AM alerts"
        )
        assert {(a["labels"]["alertname"], a["labels"]["severity"]) for a in active} == {
            ("GpuIdleRecommendation", "info")
        }
    finally:
        assert stop_service(proc) == 0
        log.close()
        am.stop()

    # report idle reads the topic by itself: per pod, exact waste; per owner and team; nothing busy.
    p = gpupipe("report", "idle", "--since", "7d", "--by", "pod", "--format", "json", *common)
    assert p.returncode == 0, p.stderr
    rows = {r["group"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {f"{w['namespace']}/{pod}" for pod, w in want.items()}
    for pod, w in want.items():
        row = rows[f"{w['namespace']}/{pod}"]
        assert row["gpu_hours_idle"] == pytest.approx(w["gpu_hours"], abs=1e-6)
        assert row["cost_wasted"] == pytest.approx(w["cost"], abs=1e-6)
        assert row["open"] == (w["status"] == "firing")
        assert row["top_action"] in ("right_size_mig", "shared_gpu")
    p = gpupipe("report", "idle", "--since", "7d", "--by", "owner", "--format", "json", *common)
    owners = {r["group"]: r["cost_wasted"] for r in json.loads(p.stdout)}
    assert owners == {w["owner"]: pytest.approx(w["cost"], abs=1e-6) for w in want.values()}
    teams = tmp_path / "teams.yaml"
    teams.write_text("teams:\n  - label: team\n    value: research\n    team: lab\n")
    p = gpupipe(
        "report", "idle", "--since", "7d", "--by", "team", "--teams", str(teams), "--format", "csv", *common
    )
    by_team = {r["group"]: float(r["cost_wasted"]) for r in csv.DictReader(io.StringIO(p.stdout))}
    want_team: dict[str, float] = {}
    for w in want.values():
        key = "lab" if w["team"] == "research" else w["namespace"]
        want_team[key] = want_team.get(key, 0.0) + w["cost"]
    assert by_team == pytest.approx(want_team, abs=1e-5)
    p = gpupipe("report", "idle", "--since", "7d", "--by", "namespace", *common)
    assert p.returncode == 0 and p.stdout.splitlines()[1].split()[:4] == ["notebooks", "4", "2", "4"], (
        p.stdout
    )
    total = sum(w["cost"] for w in want.values())
    assert p.stdout.splitlines()[-1].endswith(f"{total:.2f} USD wasted")

    # A restart (same group: no sample left to read) restores the open recommendations from its topic.
    log = open(tmp_path / "recommend2.log", "w")  # noqa: SIM115 (closed below)
    again = subprocess.Popen(
        [*GPUPIPE, "recommend", "--prices", str(PRICES), "--listen", f"127.0.0.1:{port}",
         "--group-id", f"rec-{topic_prefix}", *common],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    try:

        def restored() -> float:
            assert again.poll() is None, (tmp_path / "recommend2.log").read_text()[-3000:]
            try:
                return metric(scrape(port), "gpupipe_recommendations_open")
            except OSError:
                return 0.0

        assert wait_until(restored, 30, "restored recommendations") == len(firing)
    finally:
        assert stop_service(again) == 0
        log.close()


def test_chargeback_by_label_owner_job_and_carbon_add_up(
    kafka: str, fleet: dict[str, Any], tmp_path: Path
) -> None:
    """The chargeback service over Kafka, then report chargeback by namespace, owner, label:team, a
    label-based team map and carbon: the same totals per window, the values of the pure engine run
    on the same simulated input, and the HPC node's jobs as owners."""
    prefix, start_ms = fleet["prefix"], fleet["start_ms"]
    group, out = f"cb-{free_port()}", f"{prefix}out.cb"
    proc = start_service(
        kafka, prefix, tmp_path / "cb.log", "--window", "1h", "--grace", "1m", "--group-id", group,
        "--output-topic", out, "--prices", str(PRICES), "--instance-id", "cb-0",
    )  # fmt: skip
    prog = Progress(kafka, group, prefix + "gpu.samples.v1")
    try:
        prog.wait_done(90, [proc])
    finally:
        prog.close()
        assert stop_service(proc) == 0, (tmp_path / "cb.log").read_text()[-3000:]
    closed = HOURS - 1  # the last hour's window waits for samples that never come

    def report(*args: str) -> list[dict[str, Any]]:
        p = gpupipe(
            "report", "chargeback", "--bootstrap-servers", kafka, "--topic", out, "--format", "json", *args
        )
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def per_window(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
        t: dict[tuple[str, str], float] = {}
        for r in rows:
            for k in ("gpu_hours_allocated", "energy_kwh", "cost"):
                t[(r["window_start"], k)] = t.get((r["window_start"], k), 0.0) + r[k]
        return t

    by_ns = report("--by", "namespace")
    assert len({r["window_start"] for r in by_ns}) == closed
    ref = pytest.approx(per_window(by_ns), abs=1e-4)  # rows are rounded to 6 decimals
    by_owner = report("--by", "owner")
    by_label = report("--by", "label:team")
    teams = tmp_path / "teams.yaml"
    teams.write_text(
        "teams:\n  - label: team\n    value: research\n    team: lab\n  - namespace: '*'\n    team: other\n"
    )
    by_team = report("--by", "team", "--teams", str(teams))
    for rows in (by_owner, by_label, by_team):
        assert per_window(rows) == ref
    # Exact values: the pure engine on the same simulated input, closed windows only.
    eng = build_engine(ChargebackSettings(), load_price_table(PRICES), "x")
    fleet_sim = SimulatedFleet(fleet_config())
    offset = 0
    for i in range(HOURS * 3_600_000 // INTERVAL_MS):
        samples, _ = fleet_sim.tick(start_ms + i * INTERVAL_MS)
        for smp in samples:
            eng.add(smp, 0, offset)
            offset += 1
    records = [r for r in eng.flush_all() if r["window_start_ms"] < start_ms + closed * 3_600_000]
    want = {}
    for r in build_workload_report(records, by=("label:team",), period="all"):
        want[r.group] = want.get(r.group, 0.0) + r.gpu_hours_allocated
    got: dict[str, float] = {}
    for r in by_label:
        got[r["group"]] = got.get(r["group"], 0.0) + r["gpu_hours_allocated"]
    assert got == pytest.approx(want, abs=1e-6) and {"research", "serving", "__unallocated__"} <= set(got)
    jobs = {r["group"] for r in by_owner if r["group"].startswith("hpc/HpcJob/")}
    assert len(jobs) >= 2  # per-job chargeback for the HPC node
    lab = sum(r["gpu_hours_allocated"] for r in by_team if r["team"] == "lab")
    assert lab == pytest.approx(want["research"], abs=1e-6)
    # Measured carbon per team: energy x the example file's intensity for each node's zone.
    carbon = report("--by", "label:team", "--carbon", str(REPO / "deploy" / "carbon.example.yaml"))
    cfg = load_carbon_config(REPO / "deploy" / "carbon.example.yaml")
    want_kg = sum(
        r["energy_joules"] / 3.6e6 * cfg.intensity(r["node"], r["window_start_ms"]) / 1000 for r in records
    )
    assert sum(r["co2e_kg"] for r in carbon) == pytest.approx(want_kg, rel=1e-4)
    assert all(r["co2e_kg"] > 0 for r in carbon if r["energy_kwh"] > 0)
