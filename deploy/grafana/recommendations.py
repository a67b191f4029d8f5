"""The Chargeback dashboard's row of idle-GPU recommendations (``gpupipe recommend``'s series).

The recommend service exposes one series per open recommendation (an idle pod on a GPU, MIG slice
or shared replica), gone when it resolves: ``gpupipe_recommendation_{idle_seconds,gpu_hours_idle,
cost_wasted,saving_per_hour}`` with the labels ``namespace, pod, owner, team, Hostname, UUID,
GPU_I_PROFILE, modelName, action, target`` (and ``currency`` on the costs); see
consumers/recommend/service.py. Chargeback says what was spent; this row says what is being wasted
right now and what to do about it, under the same team/namespace/model variables (``team`` is the
namespace where no team rule matches, as chargeback's counters and the reports).

Panels count series rather than read ``gpupipe_recommendations_open`` (labelled by action only) so
that every panel follows the dashboard's variables. An empty fleet is "no data", never a padded 0
(``or vector(0)`` would hide a recommend service Prometheus does not scrape); the stats display 0.
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard
from panels import q, st, tbl, ts

REC = "gpupipe_recommendation"
# One row per recommendation in the top-wasters table: who, where, and the suggested action.
WASTER = "namespace, pod, owner, team, Hostname, modelName, GPU_I_PROFILE, action, target"
TOP = 10


def recommendation_row(d: Any, sel: str) -> Any:
    """``d`` with the row added; ``sel`` selects recommendations by the dashboard's variables."""

    def s(metric: str) -> str:
        return f"{REC}_{metric}{{{sel}}}"

    def by(labels: str, metric: str, ref: str) -> Any:
        return q(f"sum by ({labels}) ({s(metric)})", ref=ref, instant=True, fmt="table")

    def wasted(title: str, labels: str, span: int = 8) -> Any:
        return tbl(
            title,
            by(labels, "gpu_hours_idle", "A"),
            by(labels, "cost_wasted", "B"),
            desc="Open recommendations. A: GPU-hours wasted so far, B: their cost.",
            span=span,
            sort_desc="Value #B",
        )

    top = f"topk({TOP}, sum by ({WASTER}) ({s('cost_wasted')}))"

    def of_top(metric: str, ref: str) -> Any:
        return q(
            f"sum by ({WASTER}) ({s(metric)}) and on ({WASTER}) {top}", ref=ref, instant=True, fmt="table"
        )

    return (
        d.with_row(dashboard.Row("Idle GPUs: open recommendations"))
        .with_panel(
            st(
                "Open idle recommendations",
                "none",
                q(f"count({s('idle_seconds')})"),
                "Pods holding a GPU, MIG slice or shared replica idle for longer than "
                "`gpupipe recommend --idle-after` (default 2 h).",
                no_value="0",
            )
        )
        .with_panel(
            st(
                "GPU-hours wasted (open)",
                "none",
                q(f"sum({s('gpu_hours_idle')})"),
                "Since each open recommendation's pod went idle; a slice or replica counts its fraction.",
                no_value="0",
            )
        )
        .with_panel(
            st(
                "Cost wasted (open)",
                "none",
                q(f"sum({s('cost_wasted')})"),
                "Those GPU-hours at the price table's GPU-hour price, in its currency.",
                no_value="0",
            )
        )
        .with_panel(
            st(
                "Saving per hour if acted on",
                "none",
                q(f"sum({s('saving_per_hour')})"),
                "Cost per hour the suggested actions save, all of them taken.",
                no_value="0",
            )
        )
        .with_panel(
            ts(
                "Open recommendations by action",
                "none",
                q(f"count by (action) ({s('idle_seconds')})", "{{action}}"),
                stack=True,
                desc="release, right_size_mig, shared_gpu or cheaper_model (see docs/recommend.md).",
            )
        )
        .with_panel(
            ts(
                "Cost wasted by team (open)",
                "none",
                q(f"sum by (team) ({s('cost_wasted')})", "{{team}}"),
                stack=True,
                desc="Grows while a pod stays idle; drops when its recommendation resolves.",
            )
        )
        .with_panel(wasted("Wasted by team", "team"))
        .with_panel(wasted("Wasted by namespace", "team, namespace"))
        .with_panel(wasted("Wasted by owner", "namespace, owner"))
        .with_panel(
            tbl(
                f"Top {TOP} wasters and what to do",
                q(top, ref="A", instant=True, fmt="table"),
                of_top("gpu_hours_idle", "B"),
                of_top("saving_per_hour", "C"),
                desc="Open recommendations by cost wasted so far. A: cost, B: GPU-hours, C: saving per "
                "hour of the suggested action (action; target: the MIG profile, shared GPU or model "
                "to move to). Details: `gpupipe report idle --by pod`.",
                span=24,
                sort_desc="Value #A",
            )
        )
    )
