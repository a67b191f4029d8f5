"""Build the Grafana dashboards (Fleet, Chargeback, GPU health) as code with grafana-foundation-sdk.

Writes deploy/grafana/dashboards/*.json, provisioned by docker-compose.yml's Grafana and shipped by the
Helm chart as ConfigMaps for Grafana's sidecar (its files/dashboards links here).
``--check`` writes nothing and exits 1 if a committed file differs from what this code builds.

    .venv/bin/python deploy/grafana/build_dashboards.py [--check]

Series: the metrics service's dcgm-exporter names (node label ``Hostname``; queries are written with
4.8's names and panels.py makes each read of a renamed field read every generation's name, so the
panels work under any ``gpupipe metrics --dialect``), chargeback's window counters
(``gpupipe_chargeback_*_total{namespace,team,gpu_model}``), the alerts and producer services' own
metrics, and Prometheus' ``ALERTS`` from deploy/prometheus/gpupipe-alerts.rules.yml.
XIDs by recommended action and cause class are mapped in PromQL from the pinned XID catalog the
alerts service uses (schemas/xid_catalog.json), so the two never disagree.

Every variable that can select all uses ``.*`` as its "All" value, so a query with the variables
replaced by ``.*`` is exactly what Grafana sends (the data test relies on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # panels.py, recommendations.py

from grafana_foundation_sdk.builders import dashboard, statetimeline  # noqa: E402
from panels import DS, bars, base, build, ds_var, q, query_var, st, tbl, ts  # noqa: E402
from recommendations import recommendation_row  # noqa: E402

from gpupipe_consumers.alerts.rules.catalog import CATALOG_VERSION, entries  # noqa: E402

#: The one place they are written; the Helm chart's files/dashboards is a link to it.
OUT_DIR = REPO / "deploy" / "grafana" / "dashboards"
XID = "DCGM_EXP_XID_ERRORS_TOTAL"


POWER_SHARE_DESC = (
    "A GPU's power goes to the pod its series carry: a MIG GPU's is split evenly over its slices "
    "(the series carry the whole device's), a time-sliced GPU's goes to the one pod its series name."
)


# -- Fleet -------------------------------------------------------------------------------------------
def fleet() -> dict[str, Any]:
    sel = 'Hostname=~"$node", modelName=~"$model"'
    pods = f'{sel}, namespace=~"$namespace", pod!=""'
    one_per_gpu = "max by (Hostname, UUID, GPU_I_ID)"  # shared GPUs have a series per pod
    # Each MIG slice carries its GPU's whole power (as dcgm-exporter's): split it evenly over the
    # GPU's series so that a namespace's or pod's power adds up to the node's, not 7 times over.
    per_gpu = "on (Hostname, UUID) group_left count by (Hostname, UUID)"
    power_share = f"DCGM_FI_DEV_POWER_USAGE{{{pods}}} / {per_gpu} (DCGM_FI_DEV_POWER_USAGE{{{sel}}})"
    pod_gpu = "namespace, pod, Hostname, gpu, modelName, GPU_I_PROFILE"
    d = (
        base(
            "gpupipe-fleet",
            "GPU fleet",
            "Utilisation, memory, power and temperature by node, namespace and pod, with time-sliced and "
            "MIG GPUs and allocated GPUs doing nothing. Series of `gpupipe metrics` (dcgm-exporter names, "
            "any `--dialect`).",
            "now-1h",
        )
        .with_variable(ds_var())
        .with_variable(query_var("node", "Node", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)"))
        .with_variable(
            query_var(
                "model", "GPU model", 'label_values(DCGM_FI_DEV_GPU_UTIL{Hostname=~"$node"}, modelName)'
            )
        )
        .with_variable(
            query_var(
                "namespace", "Namespace", 'label_values(DCGM_FI_DEV_GPU_UTIL{Hostname=~"$node"}, namespace)'
            )
        )
        .with_row(dashboard.Row("Overview"))
        .with_panel(
            st(
                "GPUs reporting",
                "none",
                q(f"count({one_per_gpu} (DCGM_FI_DEV_GPU_UTIL{{{sel}}}))"),
                "Whole GPUs and MIG slices with a fresh sample.",
            )
        )
        .with_panel(
            st("Mean GPU utilisation", "percent", q(f"avg({one_per_gpu} (DCGM_FI_DEV_GPU_UTIL{{{sel}}}))"))
        )
        .with_panel(st("Power draw", "watt", q(f"sum({one_per_gpu} (DCGM_FI_DEV_POWER_USAGE{{{sel}}}))")))
        .with_panel(
            st(
                "Allocated GPUs idle",
                "none",
                q(f"count({one_per_gpu} (max_over_time(DCGM_FI_DEV_GPU_UTIL{{{pods}}}[10m])) < 5)"),
                "Allocated to a pod, under 5% utilisation for the last 10 minutes.",
            )
        )
        .with_row(dashboard.Row("Utilisation"))
        .with_panel(
            ts(
                "GPU utilisation by node",
                "percent",
                q(f"avg by (Hostname) ({one_per_gpu} (DCGM_FI_DEV_GPU_UTIL{{{sel}}}))", "{{Hostname}}"),
            )
        )
        .with_panel(
            ts(
                "GPU utilisation by namespace",
                "percent",
                q(f"avg by (namespace) (DCGM_FI_DEV_GPU_UTIL{{{pods}}})", "{{namespace}}"),
            )
        )
        .with_panel(
            ts(
                "Tensor core activity by namespace",
                "percentunit",
                q(f"avg by (namespace) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{pods}}})", "{{namespace}}"),
            )
        )
        .with_panel(
            tbl(
                "Pods on GPUs",
                q(
                    f"max by (namespace, pod, container, Hostname, gpu, modelName, GPU_I_PROFILE) "
                    f"(DCGM_FI_DEV_GPU_UTIL{{{pods}}})",
                    instant=True,
                    fmt="table",
                ),
                desc="Current utilisation per pod; GPU_I_PROFILE is set for MIG slices.",
            )
        )
        .with_row(dashboard.Row("Memory, power, temperature"))
        .with_panel(
            ts(
                "Framebuffer used by node",
                "decmbytes",
                q(f"sum by (Hostname) (DCGM_FI_DEV_FB_USED{{{sel}}})", "{{Hostname}}"),
                desc="Per-pod shares on time-sliced GPUs add up to the device's use.",
            )
        )
        .with_panel(
            ts(
                "Framebuffer used by namespace",
                "decmbytes",
                q(f"sum by (namespace) (DCGM_FI_DEV_FB_USED{{{pods}}})", "{{namespace}}"),
            )
        )
        .with_panel(
            ts(
                "Power by node",
                "watt",
                q(f"sum by (Hostname) ({one_per_gpu} (DCGM_FI_DEV_POWER_USAGE{{{sel}}}))", "{{Hostname}}"),
            )
        )
        .with_panel(
            ts(
                "Hottest GPU by node",
                "celsius",
                q(f"max by (Hostname) (DCGM_FI_DEV_GPU_TEMP{{{sel}}})", "{{Hostname}} GPU"),
                q(f"max by (Hostname) (DCGM_FI_DEV_MEMORY_TEMP{{{sel}}})", "{{Hostname}} memory", "B"),
            )
        )
        .with_panel(
            ts(
                "Power by namespace",
                "watt",
                q(f"sum by (namespace) ({power_share})", "{{namespace}}"),
                stack=True,
                desc=POWER_SHARE_DESC,
            )
        )
        .with_panel(
            ts(
                "Hottest GPU by namespace",
                "celsius",
                q(f"max by (namespace) (DCGM_FI_DEV_GPU_TEMP{{{pods}}})", "{{namespace}}"),
            )
        )
        .with_panel(
            tbl(
                "Pods: memory, power and temperature",
                q(f"sum by ({pod_gpu}) (DCGM_FI_DEV_FB_USED{{{pods}}})", instant=True, fmt="table"),
                q(f"sum by ({pod_gpu}) ({power_share})", ref="B", instant=True, fmt="table"),
                q(f"max by ({pod_gpu}) (DCGM_FI_DEV_GPU_TEMP{{{pods}}})", ref="C", instant=True, fmt="table"),
                desc="A: framebuffer used (MiB), B: power (W, the pod's share), C: GPU temperature (C).",
                span=24,
                sort_desc="Value #B",
            )
        )
        .with_row(dashboard.Row("Shared and MIG GPUs"))
        .with_panel(
            ts(
                "Utilisation per pod on time-sliced GPUs",
                "percent",
                q(
                    f"gpupipe_pod_gpu_util_percent{{{pods}}}",
                    "{{Hostname}} gpu {{gpu}} {{namespace}}/{{pod}}",
                ),
                desc="GPUs shared by several pods: each pod's share (per-process SM use). The DCGM_* "
                "series carry one pod per GPU, as dcgm-exporter's; the shares are gpupipe's own.",
            )
        )
        .with_panel(
            tbl(
                "MIG slices",
                q(
                    f"max by (Hostname, gpu, GPU_I_PROFILE, GPU_I_ID, namespace, pod) "
                    f'(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{sel}, GPU_I_PROFILE!=""}})',
                    instant=True,
                    fmt="table",
                ),
                desc="One row per MIG slice: its profile, holder and graphics engine activity.",
            )
        )
        .with_row(dashboard.Row("Idle allocated GPUs"))
        .with_panel(
            tbl(
                "Allocated GPUs under 5% for 10 minutes",
                q(
                    f"max by (namespace, pod, Hostname, gpu, modelName) "
                    f"(max_over_time(DCGM_FI_DEV_GPU_UTIL{{{pods}}}[10m])) < 5",
                    instant=True,
                    fmt="table",
                ),
                desc="Candidates to give back: held by a pod, next to no work.",
                span=24,
            )
        )
    )
    return build(d)


# -- Chargeback --------------------------------------------------------------------------------------
CB = "gpupipe_chargeback"


def chargeback() -> dict[str, Any]:
    sel = 'team=~"$team", namespace=~"$namespace", gpu_model=~"$model"'
    pods = f'{sel}, namespace!~"__.*"'

    unalloc = 'namespace="__unallocated__", gpu_model=~"$model"'
    models = 'gpu_model=~"$model"'

    def inc(metric: str, s: str = sel, rng: str = "$__range") -> str:
        return f"increase({CB}_{metric}_total{{{s}}}[{rng}])"

    d = (
        base(
            "gpupipe-chargeback",
            "GPU chargeback",
            "GPU-hours allocated, used and idle, and cost, per team and namespace, from the windows "
            "`gpupipe chargeback` commits (the same records `gpupipe report chargeback` sums).",
            "now-7d",
        )
        .with_variable(ds_var())
        .with_variable(query_var("team", "Team", f"label_values({CB}_cost_total, team)"))
        .with_variable(
            query_var("namespace", "Namespace", f'label_values({CB}_cost_total{{team=~"$team"}}, namespace)')
        )
        .with_variable(query_var("model", "GPU model", f"label_values({CB}_cost_total, gpu_model)"))
        .with_row(dashboard.Row("Period totals"))
        .with_panel(
            st(
                "Cost",
                "none",
                q(f"sum({inc('cost')})"),
                "Allocation and energy, in the price table's currency.",
            )
        )
        .with_panel(
            st("GPU-hours allocated to pods", "none", q(f"sum({inc('allocated_gpu_seconds', pods)}) / 3600"))
        )
        .with_panel(
            st(
                "Idle share",
                "percentunit",
                q(f"sum({inc('idle_gpu_seconds', pods)}) / sum({inc('allocated_gpu_seconds', pods)})"),
                "GPU-hours allocated to pods with no activity, over GPU-hours allocated to pods.",
            )
        )
        .with_panel(
            st(
                "Unallocated share",
                "percentunit",
                q(
                    f"sum({inc('allocated_gpu_seconds', unalloc)})"
                    f" / sum({inc('allocated_gpu_seconds', models)})"
                ),
                "Capacity no pod held, over all GPU-hours observed.",
            )
        )
        .with_row(dashboard.Row("Over time"))
        .with_panel(
            ts(
                "Cost per team",
                "none",
                q(f"sum by (team) ({inc('cost', rng='$__interval')})", "{{team}}"),
                stack=True,
                bars=True,
            )
        )
        .with_panel(
            ts(
                "GPU-hours allocated per team",
                "none",
                q(f"sum by (team) ({inc('allocated_gpu_seconds', rng='$__interval')}) / 3600", "{{team}}"),
                stack=True,
                bars=True,
            )
        )
        .with_panel(
            ts(
                "GPU-hours used and idle (pods)",
                "none",
                q(f"sum({inc('used_gpu_seconds', pods, '$__interval')}) / 3600", "used"),
                q(f"sum({inc('idle_gpu_seconds', pods, '$__interval')}) / 3600", "idle", "B"),
                stack=True,
                bars=True,
            )
        )
        .with_panel(
            ts(
                "Unallocated capacity (GPU-hours) by model",
                "none",
                q(
                    f"sum by (gpu_model) ({inc('allocated_gpu_seconds', unalloc, '$__interval')}) / 3600",
                    "{{gpu_model}}",
                ),
                stack=True,
                bars=True,
            )
        )
        .with_row(dashboard.Row("Who spends"))
        .with_panel(
            bars(
                "Top spenders (namespace)",
                "none",
                q(f"topk(10, sum by (namespace) ({inc('cost', pods)}))", "{{namespace}}", instant=True),
            )
        )
        .with_panel(
            bars(
                "Cost per team",
                "none",
                q(f"sort_desc(sum by (team) ({inc('cost')}))", "{{team}}", instant=True),
            )
        )
        .with_panel(
            tbl(
                "Per namespace and GPU model",
                q(
                    f"sum by (team, namespace, gpu_model) ({inc('allocated_gpu_seconds')}) / 3600",
                    instant=True,
                    fmt="table",
                ),
                q(
                    f"sum by (team, namespace, gpu_model) ({inc('used_gpu_seconds')}) / 3600",
                    ref="B",
                    instant=True,
                    fmt="table",
                ),
                q(
                    f"sum by (team, namespace, gpu_model) ({inc('idle_gpu_seconds')}) / 3600",
                    ref="C",
                    instant=True,
                    fmt="table",
                ),
                q(f"sum by (team, namespace, gpu_model) ({inc('cost')})", ref="D", instant=True, fmt="table"),
                desc="A: GPU-hours allocated, B: used, C: idle, D: cost.",
                span=24,
            )
        )
    )
    rec = 'team=~"$team", namespace=~"$namespace", modelName=~"$model"'  # gpupipe recommend's labels
    return build(recommendation_row(d, rec))


# -- GPU health --------------------------------------------------------------------------------------
def _by_catalog(attr: Callable[[Any], str], label: str, window: str) -> str:
    """XIDs per catalog bucket: one label_replace'd sum per bucket, joined with `or`."""
    buckets: dict[str, list[int]] = defaultdict(list)
    for e in entries("xid"):
        buckets[attr(e)].append(e.code)
    parts = [
        f'label_replace(sum(increase({XID}{{Hostname=~"$node", xid=~"{"|".join(map(str, sorted(codes)))}"}}'
        f'[{window}])), "{label}", "{name}", "", "")'
        for name, codes in sorted(buckets.items())
    ]
    return " or ".join(parts)


def health() -> dict[str, Any]:
    node = 'Hostname=~"$node"'
    d = (
        base(
            "gpupipe-gpu-health",
            "GPU health",
            "XIDs by code, cause class and NVIDIA's recommended action (XID catalog "
            f"{CATALOG_VERSION}), node storms, lost GPUs, row remapping, and the alert timeline.",
            "now-24h",
        )
        .with_variable(ds_var())
        .with_variable(query_var("node", "Node", f"label_values({XID}, Hostname)"))
        .with_row(dashboard.Row("XIDs"))
        .with_panel(st("XIDs", "none", q(f"sum(increase({XID}{{{node}}}[$__range]))")))
        .with_panel(
            st(
                "Nodes in an XID storm",
                "none",
                q('sum(gpupipe_alerts_open{scope="node"})'),
                "Open node alerts of `gpupipe alerts`: several GPUs of one node faulting together.",
            )
        )
        .with_panel(
            st(
                "Lost GPUs",
                "none",
                q("sum(gpupipe_producer_gpus_lost)"),
                "GPUs the producers see as fallen off the bus (NVML GPU is lost).",
            )
        )
        .with_panel(st("Open GPU alerts", "none", q('sum(gpupipe_alerts_open{scope="gpu"})')))
        .with_panel(
            ts(
                "XIDs by code",
                "none",
                q(f"sum by (xid) (increase({XID}{{{node}}}[$__rate_interval]))", "XID {{xid}}"),
                stack=True,
                bars=True,
            )
        )
        .with_panel(
            ts(
                "XIDs by node",
                "none",
                q(f"sum by (Hostname) (increase({XID}{{{node}}}[$__rate_interval]))", "{{Hostname}}"),
                stack=True,
                bars=True,
            )
        )
        .with_panel(
            bars(
                "XIDs by recommended action",
                "none",
                q(
                    _by_catalog(lambda e: str(e.nvidia_action), "action", "$__range"),
                    "{{action}}",
                    instant=True,
                ),
                "NVIDIA's immediate action for each XID code, from the pinned catalog.",
            )
        )
        .with_panel(
            bars(
                "XIDs by cause class",
                "none",
                q(_by_catalog(lambda e: str(e.cause_class), "cause", "$__range"), "{{cause}}", instant=True),
            )
        )
        .with_row(dashboard.Row("Nodes and GPUs"))
        .with_panel(
            tbl(
                "Node storms: GPUs with XIDs per node (10 minutes)",
                q(
                    f"count by (Hostname) (sum by (Hostname, UUID) (increase({XID}{{{node}}}[10m])) > 0)",
                    instant=True,
                    fmt="table",
                ),
            )
        )
        .with_panel(
            ts("GPU and node alerts open", "none", q("sum by (scope) (gpupipe_alerts_open)", "{{scope}}"))
        )
        .with_panel(
            tbl(
                "Row remapping",
                q(
                    f"max by (Hostname, gpu, UUID) (DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{{{node}}})",
                    instant=True,
                    fmt="table",
                ),
                q(
                    f"max by (Hostname, gpu, UUID) (DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS{{{node}}})",
                    ref="B",
                    instant=True,
                    fmt="table",
                ),
                q(
                    f"max by (Hostname, gpu, UUID) (DCGM_FI_DEV_ROW_REMAP_FAILURE{{{node}}})",
                    ref="C",
                    instant=True,
                    fmt="table",
                ),
                desc="A: uncorrectable remapped rows, B: correctable, C: remap failed (replace the GPU).",
                span=24,
            )
        )
        .with_row(dashboard.Row("Alerts"))
        .with_panel(
            statetimeline.Panel()
            .title("Alert timeline")
            .description("Prometheus alerts of deploy/prometheus/gpupipe-alerts.rules.yml, per node.")
            .datasource(DS)
            .height(10)
            .span(24)
            .with_target(
                q(
                    f'max by (alertname, Hostname) (ALERTS{{alertstate="firing", {node}}})',
                    "{{Hostname}} {{alertname}}",
                )
            )
        )
    )
    return build(d)


DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "fleet.json": fleet,
    "chargeback.json": chargeback,
    "gpu-health.json": health,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the Grafana dashboards.")
    ap.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = ap.parse_args(argv)
    stale = []
    for name, fn in DASHBOARDS.items():
        text = json.dumps(fn(), indent=2, sort_keys=True) + "\n"
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(REPO)))
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run deploy/grafana/build_dashboards.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
