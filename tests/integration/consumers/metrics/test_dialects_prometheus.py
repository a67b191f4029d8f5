"""`--dialect` through real Prometheus 2.42 and 3: NVIDIA's dashboard in each naming generation.

One simulated producer on real Kafka feeds four `gpupipe metrics`, one per dialect (``dcgm-4.8``,
``dcgm-4.9``, ``dcgm-4.10``, ``both``), each in its own consumer group. Debian's Prometheus 2.42 and
Prometheus 3 (built from its Go module) both scrape all four with the shipped job; each target
carries a ``dialect`` target label so that a query can pick one service.

The dashboards:

* ``dcgm-4.8``: NVIDIA's dcgm-exporter dashboard (Grafana 12239) as published, the fixture that
  ``test_metrics_prometheus`` uses.
* ``dcgm-4.9`` and ``dcgm-4.10``: **derived, not NVIDIA's.** NVIDIA's dashboard for the newer names
  could not be obtained here (the dcgm-exporter copy reachable stops at 4.8.2), so these are the
  4.8 dashboard's queries with every renamed metric replaced by its name in that generation, taken
  from the mapping table (``consumers/metrics/dialect.py``), and scaled back to the 4.8 unit where
  the unit changed (the factors our own rules and dashboards use, ``dialect_promql.to_48_unit``:
  the ``both`` check below shows them right on the served values). NVIDIA's panels read no
  PCIe/NVLink rate, so 4.10's four renames are queried on their own.

Each dashboard returns data exactly where its generation is served; under ``both`` the published
and the derived panels give the same numbers (to the 4.8 rounding) at one evaluation time, and the
4.10 rates equal the 4.8 ones.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from gpupipe_consumers.metrics import dialect
from gpupipe_consumers.metrics.dialect_promql import to_48_unit
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests.conftest import free_port
from tests.integration.consumers.metrics.test_prometheus import (
    dashboard_panels,
    grafana_all,
    grafana_escape,
    substitute,
    uuids,
)
from tests.integration.metrics_helpers import (
    Proc,
    Prometheus,
    http_get,
    prometheus3,
    prometheus_config,
    promtool_check,
    start_metrics,
    start_producer,
    wait_for,
)

pytestmark = pytest.mark.integration

NODES, GPUS_PER_NODE = 2, 2  # node 0: L40S (no NVLink), node 1: H200 (NVLink rates)
DIALECTS = ("dcgm-4.8", "dcgm-4.9", "dcgm-4.10", "both")

#: dialect -> the generations whose dashboard returns data there (written out, not computed: the
#: panels read no name that 4.10 renamed, so the 4.9 and 4.10 dashboards are served alike).
DASHBOARDS_SERVED = {
    "dcgm-4.8": {"dcgm-4.8"},
    "dcgm-4.9": {"dcgm-4.9", "dcgm-4.10"},
    "dcgm-4.10": {"dcgm-4.9", "dcgm-4.10"},
    "both": {"dcgm-4.8", "dcgm-4.9", "dcgm-4.10"},
}

#: 4.10.0's renames (release notes), and the dialects serving the (old, new) name.
RATES_410 = {
    "DCGM_FI_PROF_PCIE_TX_BYTES": "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND",
    "DCGM_FI_PROF_NVLINK_TX_BYTES": "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND",
    "DCGM_FI_PROF_NVLINK_RX_BYTES": "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND",
}
RATES_SERVED = {
    "dcgm-4.8": (True, False),
    "dcgm-4.9": (True, False),
    "dcgm-4.10": (False, True),
    "both": (True, True),
}

_METRIC = re.compile(r"\b(DCGM_FI_[A-Z0-9_]+)(\{[^}]*\})?")


def derived(expr: str, generation: str) -> str:
    """A 4.8 dashboard query in ``generation``'s names (DERIVED from the mapping table)."""

    def one(m: re.Match[str]) -> str:
        r = dialect.BY_OLD.get(m.group(1))
        if r is None or dialect.name_in(r, generation) == r.old:
            return m.group(0)
        back = to_48_unit(r)
        sel = r.new + (m.group(2) or "")
        return f"({sel}{back})" if back else sel

    return _METRIC.sub(one, expr)


def for_dialect(expr: str, which: str) -> str:
    """``expr`` reading only the service of dialect ``which`` (its target label)."""
    return re.sub(r"\b(DCGM_FI_[A-Z0-9_]+)\{", rf'\1{{dialect="{which}", ', expr)


def dashboards() -> tuple[dict[str, list[str]], str]:
    """(generation -> panel queries, the 4.8 metric the variables read)."""
    exprs, templating = dashboard_panels()
    assert len(exprs) == 8, exprs
    var_queries = [v["query"] for v in templating if v.get("type") == "query"]
    found = [re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*\w+\s*\)\s*", q) for q in var_queries]
    assert all(found), var_queries
    (var_metric,) = {m.group(1) for m in found if m}
    gens = {"dcgm-4.8": exprs, **{g: [derived(e, g) for e in exprs] for g in dialect.GENERATIONS[1:]}}
    # the derivation renamed every metric the panels read (a panel left in 4.8 names proves nothing)
    for g in dialect.GENERATIONS[1:]:
        for e in gens[g]:
            for name, _ in _METRIC.findall(e):
                r = dialect.BY_OLD.get(name)
                assert r is None or dialect.name_in(r, g) == name, (g, e)
    return gens, var_metric


def test_each_dialect_serves_its_generations_dashboard_through_prometheus_2_and_3(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ports = {d: free_port() for d in DIALECTS}
    procs: list[Proc] = []
    servers: dict[str, Prometheus] = {}
    try:
        for d in DIALECTS:
            procs.append(
                start_metrics(
                    kafka,
                    topic_prefix,
                    ports[d],
                    tmp_path / f"metrics-{d}.log",
                    "--dialect",
                    d,
                    "--group-id",
                    f"{topic_prefix}metrics-{d}",
                )
            )
        producer = start_producer(
            kafka,
            topic_prefix,
            tmp_path / "producer.log",
            "--nodes",
            str(NODES),
            "--gpus-per-node",
            str(GPUS_PER_NODE),
        )
        procs.append(producer)
        targets = [{"targets": [f"127.0.0.1:{ports[d]}"], "labels": {"dialect": d}} for d in DIALECTS]
        cfg = prometheus_config(static_configs=targets)
        for name, binary in (("2.42", None), ("3", prometheus3()[0])):
            servers[name] = Prometheus(cfg, tmp_path / f"prom-{name}", free_port(), binary=binary)

        sim = SimulatedFleet(FleetConfig(nodes=NODES, gpus_per_node=GPUS_PER_NODE)).tick(
            int(time.time() * 1000)
        )[0]
        sim_uuids = {r["uuid"] for r in sim}
        nvlink_uuids = {r["uuid"] for r in sim if r.get("nvlink_tx_bytes_per_s") is not None}
        assert len(sim_uuids) == NODES * GPUS_PER_NODE and nvlink_uuids and nvlink_uuids != sim_uuids
        temp = {"dcgm-4.8": "DCGM_FI_DEV_GPU_TEMP", "both": "DCGM_FI_DEV_GPU_TEMP"}

        def everything_scraped() -> bool:
            for p in procs:
                assert p.alive(), f"a service exited:\n{p.log_tail()}"
            return all(
                sim_uuids
                <= uuids(prom.query(f'{temp.get(d, "DCGM_FI_DEV_GPU_TEMP_CELSIUS")}{{dialect="{d}"}}'))
                and nvlink_uuids
                <= uuids(prom.query(f'{{__name__=~"DCGM_FI_PROF_NVLINK_TX_BYTES.*",dialect="{d}"}}'))
                for prom in servers.values()
                for d in DIALECTS
            )

        for prom in servers.values():
            prom.wait_ready()
        wait_for(everything_scraped, 90, "both servers to hold every GPU of every dialect")

        gens, var_metric = dashboards()
        one = next(r for r in sim if r["uuid"] in nvlink_uuids)
        for server, prom in servers.items():
            for d in DIALECTS:
                for gen, exprs in gens.items():
                    check_dashboard(prom, server, d, gen, exprs, var_metric, sim_uuids, one)
                check_rates(prom, server, d, sim_uuids, nvlink_uuids)
            check_both_agree(prom, server, gens, sim_uuids)

        for d in DIALECTS:  # each dialect's exposition, linted by promtool
            assert promtool_check(http_get(f"http://127.0.0.1:{ports[d]}/metrics")) == [], d
    except BaseException:
        for p in procs:
            print(f"--- {p.log_path.name} ---\n{p.log_tail()}")
        for name, prom in servers.items():
            print(f"--- prometheus {name} ---\n{prom.log_tail()}")
        raise
    finally:
        for prom in servers.values():
            prom.stop()
        rcs = {p.log_path.name: p.stop() for p in procs}
    assert set(rcs.values()) == {0}, rcs


def check_dashboard(
    prom: Prometheus,
    server: str,
    which: str,
    gen: str,
    exprs: list[str],
    var_metric: str,
    sim_uuids: set[str],
    one: dict[str, Any],
) -> None:
    """Every panel of generation ``gen``'s dashboard, variables as Grafana fills them ("All" and one
    GPU), on the service of dialect ``which``: data for every GPU where ``gen`` is served, none
    where it is not."""
    served = gen in DASHBOARDS_SERVED[which]
    metric = derived(var_metric, gen)
    instances = prom.label_values("instance", f'{metric}{{dialect="{which}"}}')
    gpus = prom.label_values("gpu", f'{metric}{{dialect="{which}"}}')
    where = f"Prometheus {server}, --dialect {which}, {gen} dashboard"
    if not served:
        assert instances == [] and gpus == [], (where, instances)
        for expr in exprs:
            q = for_dialect(substitute(expr, {"instance": ".*", "gpu": ".*"}), which)
            assert prom.query(q) == [], f"{where}: {q} returned data"
        return
    assert {"sim-node-0000", "sim-node-0001"} <= set(instances), (where, instances)
    choices = {
        "All": {"instance": grafana_all(instances), "gpu": grafana_all(gpus)},
        "one": {"instance": grafana_escape(one["hostname"]), "gpu": str(one["gpu_index"])},
    }
    for choice, values in choices.items():
        for expr in exprs:
            q = for_dialect(substitute(expr, values), which)
            result = prom.query(q)
            assert result, f"{where}: panel returned nothing ({choice}): {q}"
            if expr.lstrip().startswith(("avg(", "sum(")):
                assert len(result) == 1 and float(result[0]["value"][1]) > 0, (where, q, result)
            elif choice == "All":
                assert sim_uuids <= uuids(result), f"{where}: {q}: missing {sim_uuids - uuids(result)}"
            else:
                assert uuids(result) == {one["uuid"]}, (where, q, result)
            if "SM_CLOCK" in expr:  # Hz on the panel in every generation
                assert all(float(r["value"][1]) >= 1e8 for r in result), (where, result)


def check_rates(
    prom: Prometheus, server: str, which: str, sim_uuids: set[str], nvlink_uuids: set[str]
) -> None:
    """4.10's renamed PCIe/NVLink rates: under the 4.8/4.9 name, the 4.10 name, or both."""
    old_served, new_served = RATES_SERVED[which]
    for old, new in RATES_410.items():
        expected = nvlink_uuids if "NVLINK" in old else sim_uuids
        for name, served in ((old, old_served), (new, new_served)):
            got = uuids(prom.query(f'{name}{{dialect="{which}"}}'))
            assert got == (expected if served else set()), (server, which, name, got)


def check_both_agree(prom: Prometheus, server: str, gens: dict[str, list[str]], sim_uuids: set[str]) -> None:
    """Under ``both`` one scrape carries every generation: at one evaluation time the published
    and the derived panels agree to the 4.8 rounding (whole %, whole MiB), the rates exactly."""
    at = time.time()
    values = {"instance": ".*", "gpu": ".*"}
    for i, expr in enumerate(gens["dcgm-4.8"]):

        def by_gpu(q: str) -> dict[str, float]:
            res = prom.query(for_dialect(substitute(q, values), "both"), at=at)
            return {r["metric"].get("UUID", ""): float(r["value"][1]) for r in res}

        old = by_gpu(expr)
        assert old and (set(old) == {""} or sim_uuids <= set(old)), (server, expr, old)
        for gen in dialect.GENERATIONS[1:]:
            new = by_gpu(gens[gen][i])
            assert new.keys() == old.keys(), (server, gens[gen][i], new, old)
            for k, v in old.items():
                assert abs(new[k] - v) <= 1.0, (server, expr, gens[gen][i], k, v, new[k])
    for old_name, new_name in RATES_410.items():
        old = prom.query(f'{old_name}{{dialect="both"}}', at=at)
        new = prom.query(f'{new_name}{{dialect="both"}}', at=at)
        assert old and {r["metric"]["UUID"]: r["value"][1] for r in old} == {
            r["metric"]["UUID"]: r["value"][1] for r in new
        }, (server, old_name, old, new)
