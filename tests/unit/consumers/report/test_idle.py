"""`gpupipe report idle`: latest revision per recommendation, grouping, formats."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest

from gpupipe_consumers.report.errors import ReportOptionError
from gpupipe_consumers.report.formats import FORMATS
from gpupipe_consumers.report.idle_command import since_ms
from gpupipe_consumers.report.idle_html import render_idle_html
from gpupipe_consumers.report.idle_report import build_idle_report, render_idle, selected

H = 3_600_000


def rec(rid: str, seq: int, ns: str, pod: str, hours: float, **kw: Any) -> dict[str, Any]:
    r = {
        "recommendation_id": rid,
        "sequence": seq,
        "status": "firing",
        "namespace": ns,
        "pod": pod,
        "owner_kind": None,
        "owner_name": None,
        "team": None,
        "labels": {},
        "idle_since_ms": 10 * H,
        "last_seen_ms": 10 * H + int(hours * H),
        "gpu_hours_idle": hours,
        "cost_wasted": hours * 2.0,
        "currency": "USD",
        "action": "right_size_mig",
        "target": "1g.10gb",
        "saving_per_hour": 1.5,
    }
    r.update(kw)
    return r


RECORDS = [
    rec("a", 1, "notebooks", "nb-1", 2.0, owner_kind="Notebook", owner_name="nb", labels={"team": "ds"}),
    rec("a", 3, "notebooks", "nb-1", 3.0, owner_kind="Notebook", owner_name="nb", labels={"team": "ds"}),
    rec("a", 2, "notebooks", "nb-1", 2.5, owner_kind="Notebook", owner_name="nb", labels={"team": "ds"}),
    rec("b", 2, "notebooks", "nb-2", 4.0, status="resolved", action="release", target=None),
    rec("c", 1, "vision", "v-1", 2.0, team="cv", last_seen_ms=1 * H),
]


def test_latest_revision_grouping_and_since() -> None:
    rows = build_idle_report(RECORDS, by="namespace", since_ms=5 * H)
    assert [(r.group, r.recommendations, r.open, round(r.gpu_hours_idle, 6)) for r in rows] == [
        ("notebooks", 2, 1, 7.0)
    ]
    assert rows[0].cost_wasted == 14.0 and rows[0].saving_per_hour == 1.5
    owners = build_idle_report(RECORDS, by="owner")
    assert [(r.group, r.cost_wasted) for r in owners] == [
        ("notebooks/Pod/nb-2", 8.0),
        ("notebooks/Notebook/nb", 6.0),
        ("vision/Pod/v-1", 4.0),
    ]
    teams = build_idle_report(RECORDS, by="team", team_of=lambda ns, labels: labels.get("team"))
    assert [(r.group, r.cost_wasted) for r in teams] == [("notebooks", 8.0), ("ds", 6.0), ("cv", 4.0)]
    assert [r.group for r in build_idle_report(RECORDS, by="pod", top=1)] == ["notebooks/nb-2"]
    with pytest.raises(ReportOptionError):
        build_idle_report(RECORDS, by="node")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_renders(fmt: str) -> None:
    rows = build_idle_report(RECORDS, by="owner")
    text = render_idle_html(rows, selected(RECORDS)) if fmt == "html" else render_idle(rows, fmt)
    if fmt == "json":
        data = json.loads(text)
        assert data[0]["group"] == "notebooks/Pod/nb-2" and data[0]["cost_wasted"] == 8.0
        assert data[0]["top_action"] == "release" and data[0]["top_target"] is None
    elif fmt == "jsonl":
        assert [json.loads(line)["group"] for line in text.splitlines()][1] == "notebooks/Notebook/nb"
    elif fmt == "csv":
        first = next(csv.DictReader(io.StringIO(text)))
        assert first["cost_wasted"] == "8.000000" and first["pods"] == "1"
    elif fmt == "focus":
        first = next(csv.DictReader(io.StringIO(text)))
        assert first["BilledCost"] == "0.000000" and first["x_WastedCost"] == "8.000000"
        assert first["x_RecommendedAction"] == "release"
    elif fmt == "html":
        assert text.startswith("<!DOCTYPE html>") and "http" not in text  # self-contained
        assert '<div class="v" id="total-idle">9.00</div>' in text
        assert '<div class="v" id="total-wasted">18.00 USD</div>' in text
        assert 'data-group="notebooks/Pod/nb-2"' in text
    else:
        lines = text.splitlines()
        assert lines[0].split()[0] == "OWNER" and "1g.10gb" in lines[2]
        assert lines[-1] == "… TOTAL 9.00 GPU-h idle, 18.00 USD wasted"


def test_since_accepts_durations_and_dates() -> None:
    assert since_ms("7d", 10 * 86_400_000) == 3 * 86_400_000
    assert since_ms("2026-11-01", 0) == 1_793_491_200_000
