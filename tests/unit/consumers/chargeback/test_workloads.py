"""Chargeback by owner, by pod label, by team from label values, and measured carbon: exact values from
the simulated fleet's ground truth, and the same invariant as the namespace view."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections import defaultdict
from pathlib import Path

import pytest

from gpupipe.domain.prices import load_price_table
from gpupipe.domain.teams import parse_team_map
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.report.carbon import CarbonConfigError, load_carbon_config, parse_carbon_config
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.formats import render_report
from gpupipe_consumers.report.workload_report import build_workload_report
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.meaning import PSEUDO_NAMESPACES
from tests.paths import REPO

REPO = REPO
START = 1_790_000_000_000 - 1_790_000_000_000 % 3_600_000
INTERVAL = 60_000
TICKS = 3 * 60


def run_fleet() -> tuple[list[dict], dict[str, float], dict[str, float]]:
    """ChargebackWindow records of 3 simulated hours (no MIG, no time-slicing: one holder per GPU), and
    the ground truth: GPU-seconds per team label and per owner."""
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=4, gpus_per_node=4, interval_ms=INTERVAL, seed=3, mig_node_ratio=0, shared_node_ratio=0
        )
    )
    eng = build_engine(ChargebackSettings(), load_price_table(REPO / "deploy" / "prices.example.yaml"), "t")
    by_team: dict[str, float] = defaultdict(float)
    by_owner: dict[str, float] = defaultdict(float)
    offset = 0
    for i in range(TICKS):
        samples, _ = fleet.tick(START + i * INTERVAL)
        for s in samples:
            eng.add(s, 0, offset)
            offset += 1
            for a in s["allocations"]:
                by_team[a["labels"]["team"]] += INTERVAL / 1000
                by_owner[f"{a['namespace']}/{a['owner_kind']}/{a['owner_name']}"] += INTERVAL / 1000
            if not s["allocations"]:
                by_team["__unallocated__"] += INTERVAL / 1000
                by_owner["__unallocated__"] += INTERVAL / 1000
    return eng.flush_all(), dict(by_team), dict(by_owner)


def per_group(rows, attr: str) -> dict[str, float]:
    """GPU-hours per group over GPU models (a row is per group and model)."""
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        out[getattr(r, attr)] += r.gpu_hours_allocated
    return dict(out)


@pytest.fixture(scope="module")
def fleet() -> tuple[list[dict], dict[str, float], dict[str, float]]:
    return run_fleet()


def test_breakdown_adds_up_to_each_row_and_round_trips(fleet) -> None:
    records, _, _ = fleet
    enc, codec = AvroCodec().encoder("ChargebackWindow"), AvroCodec()
    for r in records:
        if r["namespace"] in PSEUDO_NAMESPACES:
            assert r["workloads"] == []
            continue
        assert r["workloads"]
        for k in ("allocated_gpu_seconds", "energy_joules", "cost_total"):
            assert sum(w[k] for w in r["workloads"]) == pytest.approx(r[k], rel=1e-12)
        assert codec.decode(enc.encode(r)).record == r


def test_by_label_and_owner_match_ground_truth_and_the_namespace_invariant(fleet) -> None:
    records, by_team, by_owner = fleet
    hours = per_group(build_workload_report(records, by=("label:team",), period="all"), "group")
    assert hours.keys() == by_team.keys() and len(hours) >= 4
    for team, seconds in by_team.items():
        assert hours[team] == pytest.approx(seconds / 3600, rel=1e-12), team
    owners = build_workload_report(records, by=("owner",), period="all")
    assert {k: v * 3600 for k, v in per_group(owners, "group").items()} == pytest.approx(by_owner, rel=1e-12)
    assert {r.group.split("/")[1] for r in owners if r.group != "__unallocated__"} >= {
        "PyTorchJob",
        "Deployment",
    }

    # Same totals per window as the namespace view: GPU-hours, energy, cost.
    def per_window(rows) -> dict[tuple[int, int], float]:
        out: dict[tuple[int, int], float] = defaultdict(float)
        for r in rows:
            for i, v in enumerate((r.gpu_hours_allocated, r.energy_kwh, r.cost)):
                out[(r.window_start_ms, i)] += v
        return dict(out)

    by_ns = pytest.approx(per_window(build_report(records, by=("namespace",))), rel=1e-9)
    assert per_window(build_workload_report(records, by=("owner",))) == by_ns
    assert per_window(build_workload_report(records, by=("label:team",))) == by_ns
    teams = parse_team_map(
        {"teams": [{"label": "team", "value": "serving", "team": "prod"}, {"namespace": "*", "team": "rest"}]}
    )
    team_rows = build_workload_report(records, by=("team",), teams=teams, period="all")
    assert per_window(team_rows) != {}  # period=all: one window key
    got = {k: v * 3600 for k, v in per_group(team_rows, "team").items()}
    assert got["prod"] == pytest.approx(by_team["serving"], rel=1e-12)
    assert sum(got.values()) == pytest.approx(sum(by_team.values()), rel=1e-12)


def test_carbon_per_team_from_measured_energy(fleet, tmp_path: Path) -> None:
    records, _, _ = fleet
    series = tmp_path / "series.csv"
    hour = 3_600_000
    series.write_text(
        f"zone,start,gco2e_per_kwh\neu-north-1a,{_iso(START)},40\neu-north-1a,{_iso(START + hour)},60\n"
    )
    cfg = parse_carbon_config(
        {
            "pue": 1.1,
            "default_gco2e_per_kwh": 500,
            "zones": {"us-east-1a": 380},
            "nodes": [
                {"match": "sim-node-0000", "zone": "eu-north-1a"},
                {"match": "sim-node-0001", "zone": "us-east-1a"},
            ],
            "series": str(series),
        }
    )
    assert (
        cfg.intensity("sim-node-0000", START + 10) == 40
        and cfg.intensity("sim-node-0000", START + hour) == 60
    )
    assert cfg.intensity("sim-node-0001", START) == 380 and cfg.intensity("sim-node-0003", START) == 500
    rows = build_workload_report(records, by=("label:team",), period="all", carbon=cfg.co2e_kg)
    expected = 0.0
    for r in records:
        expected += r["energy_joules"] / 3.6e6 * 1.1 * cfg.intensity(r["node"], r["window_start_ms"]) / 1000
    assert sum(r.co2e_kg for r in rows) == pytest.approx(expected, rel=1e-9)
    assert all(r.co2e_kg > 0 for r in rows if r.energy_kwh > 0)
    focus = list(csv.DictReader(io.StringIO(render_report(rows, "focus"))))
    energy_lines = [line for line in focus if line["ConsumedUnit"] == "kWh"]
    assert sum(float(line["x_CarbonGCO2e"]) for line in energy_lines) == pytest.approx(
        expected * 1000, rel=1e-6
    )
    assert {line["x_GroupBy"] for line in focus} == {"label:team"}
    table = render_report(rows, "table")
    assert "CO2E KG" in table.splitlines()[0] and "LABEL:TEAM" in table.splitlines()[0]


def test_carbon_config_errors(tmp_path: Path) -> None:
    with pytest.raises(CarbonConfigError, match="pue"):
        parse_carbon_config({"pue": 0.5})
    with pytest.raises(CarbonConfigError, match="no carbon intensity"):
        parse_carbon_config({"zones": {"a": 1}}).intensity("n", 0)
    with pytest.raises(CarbonConfigError, match="keys"):
        parse_carbon_config({"zone": {}})
    bad = tmp_path / "c.yaml"
    bad.write_text("series: missing.csv\n")
    with pytest.raises(CarbonConfigError, match="cannot read series"):
        load_carbon_config(bad)
    assert load_carbon_config(REPO / "deploy" / "carbon.example.yaml").intensity("sim-node-0001", 0) == 45


def _iso(ms: int) -> str:
    from gpupipe_consumers.report.formats import iso

    return iso(ms)


def test_hpc_node_jobs_in_samples_xids_and_per_job_chargeback() -> None:
    base = FleetConfig(nodes=2, gpus_per_node=4, interval_ms=INTERVAL, seed=5, xid_rate_per_gpu_hour=30.0)
    plain = SimulatedFleet(base)
    fleet = SimulatedFleet(dataclasses.replace(base, hpc_nodes=1))
    eng = build_engine(ChargebackSettings(), load_price_table(REPO / "deploy" / "prices.example.yaml"), "t")
    per_job: dict[str, float] = defaultdict(float)
    job_xids = 0
    for i in range(2 * 60):
        ts = START + i * INTERVAL
        samples, xids = fleet.tick(ts)
        other, _ = plain.tick(ts)
        assert samples[: len(other)] == other  # the HPC node changes nothing of the others
        for s in samples[len(other) :]:
            assert s["hostname"] == "sim-node-hpc-00" and s["mig"] is None
            for a in s["allocations"]:
                assert (a["namespace"], a["owner_kind"], a["hpc_job"]) == ("hpc", "HpcJob", a["pod"])
                per_job[a["hpc_job"]] += INTERVAL / 1000
        for x in xids:
            if x["hostname"] == "sim-node-hpc-00" and x["allocations"]:
                assert x["allocations"][0]["hpc_job"]
                job_xids += 1
        for n, s in enumerate(samples):
            eng.add(s, 0, i * len(samples) + n)
    assert len(per_job) >= 4 and job_xids >= 1
    rows = build_workload_report(eng.flush_all(), by=("namespace", "owner"), period="all")
    got = {r.group: r.gpu_hours_allocated * 3600 for r in rows if r.namespace == "hpc"}
    assert got == pytest.approx({f"hpc/HpcJob/{j}": v for j, v in per_job.items()}, rel=1e-12)


def test_zone_from_the_nodes_zone_label(tmp_path: Path) -> None:
    """The node's zone from `kubectl get nodes -o json` (NodeList shape), before the name globs."""
    nodes = {
        "kind": "NodeList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "123"},
        "items": [
            {
                "kind": "Node",
                "apiVersion": "v1",
                "metadata": {
                    "name": "sim-node-0002",
                    "labels": {"topology.kubernetes.io/zone": "eu-north-1a", "kubernetes.io/hostname": "x"},
                },
            },
            {"kind": "Node", "apiVersion": "v1", "metadata": {"name": "sim-node-0003", "labels": {}}},
        ],
    }
    (tmp_path / "nodes.json").write_text(json.dumps(nodes))
    (tmp_path / "carbon.yaml").write_text(
        "node_list: nodes.json\nzones: {eu-north-1a: 45, us-east-1a: 380}\n"
        "nodes: [{match: 'sim-node-*', zone: us-east-1a}]\n"
    )
    cfg = load_carbon_config(tmp_path / "carbon.yaml")
    assert cfg.intensity("sim-node-0002", 0) == 45 and cfg.intensity("sim-node-0003", 0) == 380
    (tmp_path / "nodes.json").write_text("[]")
    with pytest.raises(CarbonConfigError, match="NodeList"):
        load_carbon_config(tmp_path / "carbon.yaml")
