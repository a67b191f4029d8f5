"""Panel building blocks of the dashboards (build_dashboards.py): queries, variables, panels.

Apart from the dashboards themselves so that each dashboard module stays short and every panel of
every dashboard is made the same way: the Prometheus datasource variable on every query, the
variables' "All" value ``.*`` (the data test substitutes it), unique panel ids, and every read of
a field dcgm-exporter renamed made in each generation's names (queries are written with 4.8's; see
``gpupipe_consumers.metrics.dialect_promql``), so the panels work under any ``gpupipe metrics --dialect``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig, TableSortByFieldState
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueGraphMode, GraphDrawStyle, StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from gpupipe_consumers.metrics.dialect_promql import every_generation, every_generation_match

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["gpupipe", "gpu"]


def q(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, fmt: str | None = None) -> Any:
    t = prometheus.Dataquery().expr(every_generation(expr)).ref_id(ref).datasource(DS)
    if legend:
        t = t.legend_format(legend)
    if instant:
        t = t.instant()
    if fmt:
        t = t.format(PromQueryFormat(fmt))
    return t


def ds_var() -> Any:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


_LABEL_VALUES = re.compile(r"label_values\((.+),\s*(\w+)\)")


def query_var(name: str, label: str, query: str, *, multi: bool = True) -> Any:
    """A variable of ``label_values(SELECTOR, label)``; a selector of a renamed field matches it
    under every generation's name (``label_values`` takes a selector, not an expression)."""
    m = _LABEL_VALUES.fullmatch(query)
    if m is None:
        raise ValueError(f"not a label_values(selector, label) query: {query!r}")
    query = f"label_values({every_generation_match(m.group(1))}, {m.group(2)})"
    v = (
        dashboard.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DS)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        v = v.multi(True).include_all(True).all_value(".*")
    return v


def ts(title: str, unit: str, *targets: Any, stack: bool = False, bars: bool = False, desc: str = "") -> Any:
    p = timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(12)
    if desc:
        p = p.description(desc)
    if stack:
        p = p.stacking(_stack())
    if bars:
        p = p.draw_style(GraphDrawStyle.BARS).fill_opacity(80)
    for t in targets:
        p = p.with_target(t)
    return p


def _stack() -> Any:
    return StackingConfig().mode(StackingMode.NORMAL)


def st(title: str, unit: str, target: Any, desc: str = "", span: int = 6, no_value: str = "") -> Any:
    """A stat; ``no_value`` is what it shows for an empty result (display only: the query stays
    empty, so the data test still sees whether the series exist)."""
    p = (
        stat.Panel()
        .title(title)
        .unit(unit)
        .datasource(DS)
        .height(4)
        .span(span)
        .graph_mode(BigValueGraphMode.NONE)
        .with_target(target)
    )
    if no_value:
        p = p.no_value(no_value)
    return p.description(desc) if desc else p


def tbl(title: str, *targets: Any, desc: str = "", span: int = 12, sort_desc: str = "") -> Any:
    """A table of instant queries, merged into one row per label set when there are several;
    ``sort_desc``: the column (display name, e.g. ``Value #A``) it opens sorted by, largest first."""
    p = table.Panel().title(title).datasource(DS).height(8).span(span)
    if desc:
        p = p.description(desc)
    if sort_desc:
        p = p.sort_by([TableSortByFieldState().display_name(sort_desc).desc(True)])
    for t in targets:
        p = p.with_target(t)
    if len(targets) > 1:
        p = p.with_transformation(DataTransformerConfig(id_val="merge", options={}))
    return p


def bars(title: str, unit: str, target: Any, desc: str = "", span: int = 12) -> Any:
    p = bargauge.Panel().title(title).unit(unit).datasource(DS).height(8).span(span).with_target(target)
    return p.description(desc) if desc else p


def build(d: Any) -> dict[str, Any]:
    doc = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))
    for n, panel in enumerate(doc["panels"], 1):  # Grafana needs unique panel ids
        panel["id"] = n
    return doc


def base(uid: str, title: str, desc: str, time_from: str) -> Any:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(desc)
        .tags(TAGS)
        .editable()
        .refresh("30s")
        .time(time_from, "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
    )
