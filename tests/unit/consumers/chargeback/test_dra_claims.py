"""Chargeback by DRA ResourceClaim: claims of two namespaces sharing one GPU (the DRA driver's
consumable shares) each pay their measured use plus half the idle time, never 100 % each and never 0
to the heavy user; ``--by claim`` groups from the rows' workload breakdown and adds up to them."""

from __future__ import annotations

import pytest

from gpupipe.domain.prices import load_price_table
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.workload_report import build_workload_report
from tests.paths import REPO
from tests.synthetic_fleet import blank_sample
from tests.unit.consumers.chargeback.test_shared_gpus import proc

REPO = REPO
T0 = 1_790_000_000_000 - 1_790_000_000_000 % 3_600_000
STEP = 60_000


def claim(ns: str, pod: str, name: str, device: str = "gpu-0") -> dict:
    return {"namespace": ns, "pod": pod, "container": "main", "resource_name": "gpu.nvidia.com",
            "replica": None, "claim_name": name, "claim_namespace": ns, "dra_pool": "n1",
            "dra_device": device}  # fmt: skip


def windows(allocations: list[dict], processes: list[dict], gpu: str = "GPU-a") -> list[dict]:
    eng = build_engine(ChargebackSettings(), load_price_table(REPO / "deploy" / "prices.example.yaml"), "t")
    for i in range(60):  # one hour of samples, each for the minute it starts
        s = blank_sample(
            timestamp_ms=T0 + i * STEP, hostname="n1", gpu_index=0, uuid=gpu, pci_bus_id="0:1",
            model_name="NVIDIA H200", interval_ms=STEP, gpu_util_ratio=0.8, power_w=500.0,
            total_energy_mj=i * 30_000_000, allocations=allocations, processes=processes,
        )  # fmt: skip
        eng.add(s, 0, i)
    return eng.flush_all()


def per(rows, attr: str = "namespace") -> dict[str, tuple[float, float, float]]:
    out: dict[str, tuple[float, float, float]] = {}
    for r in rows:
        a, e, c = out.get(getattr(r, attr), (0.0, 0.0, 0.0))
        out[getattr(r, attr)] = (a + r.gpu_hours_allocated, e + r.energy_kwh, c + r.cost)
    return out


def test_two_namespaces_claims_on_one_gpu_split_by_measured_use() -> None:
    allocs = [claim("team-a", "a-0", "big"), claim("team-b", "b-0", "small")]
    procs = [proc("team-a", "a-0", 0.6, pid=10), proc("team-b", "b-0", 0.2, pid=20)]
    recs = windows(allocs, procs)
    rows = build_workload_report(recs, by=("claim",), period="all")
    by_claim = {r.group: (r.gpu_hours_allocated, r.energy_kwh, r.cost) for r in rows}
    # 0.6 + half the idle 0.2, and 0.2 + the other half: of one GPU-hour and 0.5 kWh.
    assert by_claim["team-a/big"][0] == pytest.approx(0.7, rel=1e-9)
    assert by_claim["team-b/small"][0] == pytest.approx(0.3, rel=1e-9)
    assert by_claim["team-a/big"][1] == pytest.approx(0.7 * 0.5, rel=1e-9)
    assert by_claim["team-b/small"][1] == pytest.approx(0.3 * 0.5, rel=1e-9)
    assert set(by_claim) == {"team-a/big", "team-b/small"}
    # The claim view adds up to the namespace view, cost included.
    spaces = per(build_report(recs, by=("namespace",), period="all"))
    assert spaces["team-a"] == pytest.approx(by_claim["team-a/big"], rel=1e-9)
    assert spaces["team-b"] == pytest.approx(by_claim["team-b/small"], rel=1e-9)


def test_device_plugin_pods_are_no_claim_and_claims_of_one_namespace_stay_apart() -> None:
    plugin = [{"namespace": "team-a", "pod": "old-0", "container": "main", "resource_name": "nvidia.com/gpu",
               "replica": None}]  # fmt: skip
    recs = windows(plugin, [], gpu="GPU-b") + windows(
        [claim("team-a", "x-0", "x"), claim("team-a", "y-0", "y")],
        [proc("team-a", "x-0", 0.5, pid=1), proc("team-a", "y-0", 0.1, pid=2)],
    )
    by_claim = {
        r.group: r.gpu_hours_allocated for r in build_workload_report(recs, by=("claim",), period="all")
    }
    assert by_claim == pytest.approx({"team-a/(no claim)": 1.0, "team-a/x": 0.7, "team-a/y": 0.3}, rel=1e-9)


def test_the_claim_is_in_each_rows_breakdown() -> None:
    recs = windows([claim("team-a", "a-0", "big")], [proc("team-a", "a-0", 0.9)])
    (row,) = [r for r in recs if r["namespace"] == "team-a"]
    assert [w["claim_name"] for w in row["workloads"]] == ["big"]
