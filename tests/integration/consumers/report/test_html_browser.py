"""`gpupipe report chargeback --format html` end to end: real broker, real CLI, real headless chromium.

Chargeback windows of the simulated fleet (accounted in-process by the chargeback engine) go to a
real topic; the real CLI writes the page; Debian's chromium renders it. The screenshot must not be
blank (many colours, no colour filling almost everything, the chart's team colours present) and
the DOM chromium built must hold the totals the report rows add up to.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer
from PIL import Image

from gpupipe.domain.teams import parse_team_map
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.html_report import PALETTE
from gpupipe_consumers.report.idle_html import render_idle_html
from gpupipe_consumers.report.idle_report import build_idle_report
from gpupipe_schemas.codec import AvroCodec
from scripts.report_example_data import EXAMPLE_TEAMS, simulated_windows
from tests.integration.browser_util import colour_stats, dump_dom, page_width, print_pdf, screenshot
from tests.integration.kafka_util import REPO, gpupipe

pytestmark = pytest.mark.integration


def _hex(rgb: str) -> tuple[int, int, int]:
    return int(rgb[1:3], 16), int(rgb[3:5], 16), int(rgb[5:7], 16)


def test_html_report_renders_in_chromium(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    records = simulated_windows(6, nodes=2)
    ensure_topics(kafka, [topics.CHARGEBACK], prefix=topic_prefix)
    enc = AvroCodec().encoder("ChargebackWindow")
    prod = Producer({"bootstrap.servers": kafka, "enable.idempotence": True})
    for r in records:
        prod.produce(topics.with_prefix(topic_prefix, topics.CHARGEBACK), enc.encode(r), key=r["namespace"])
    assert prod.flush(30) == 0
    teams_file = tmp_path / "teams.yaml"
    teams_file.write_text(yaml.safe_dump(EXAMPLE_TEAMS))

    args = ("--by", "team", "--teams", str(teams_file), "--period", "hour")
    res = gpupipe(
        "report", "chargeback", "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix,
        "--format", "html", *args, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    page = tmp_path / "report.html"
    page.write_text(res.stdout)

    rows = build_report(records, by=("team",), teams=parse_team_map(EXAMPLE_TEAMS), period="hour")
    total_cost = f"{sum(r.cost for r in rows):,.2f} USD"
    total_hours = f"{sum(r.gpu_hours_allocated for r in rows):,.2f}"
    assert total_hours == f"{2 * 8 * 6:,.2f}"  # 2 nodes x 8 GPU slots x 6 h, every slot accounted

    png = tmp_path / "report.png"
    screenshot(page, png, tmp_path / "profile")
    distinct, dominant = colour_stats(png)
    assert distinct > 50 and dominant < 0.9, (distinct, dominant)
    with Image.open(png) as img:
        seen = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 24)}
    assert _hex(PALETTE[0]) in seen and _hex(PALETTE[1]) in seen  # the chart's bars were drawn

    dom = dump_dom(page, tmp_path / "profile")
    assert f'<div class="v">{total_cost}</div>' in dom
    assert f'<div class="v">{total_hours}</div>' in dom
    assert f'id="team-total-cost">{total_cost}</td>' in dom
    for team in {r.team for r in rows}:
        assert f'data-team="{team}"' in dom
    assert dom.count("<rect ") > 2 * 6 * 3  # six stacked bars of several teams, hours and cost
    cost_chart = dom[dom.index('<svg id="cost-chart"') :]
    assert "cost (USD)" in cost_chart[: cost_chart.index("</svg>")]

    # Print-friendly: chromium prints it to a few pages (the 6 h x teams table spills over).
    pdf = print_pdf(page, tmp_path / "report.pdf", tmp_path / "profile")
    pages = len(re.findall(rb"/Type\s*/Page\b", pdf))
    assert pdf.startswith(b"%PDF") and 1 <= pages <= 20, pages


H = 3_600_000
DAY = 24 * H
_IDLE_TEAMS = {
    "serving": ("inference", "Deployment"),
    "ml": ("llm-train", "PyTorchJob"),
    "research": ("nb", "Notebook"),
}
_ACTIONS = (("release", None), ("right_size_mig", "1g.10gb"), ("shared_gpu", "nvidia.com/gpu.shared"),
            ("cheaper_model", "NVIDIA L4"))  # fmt: skip


def _recommendation(i: int, team: str, start: int) -> dict[str, Any]:
    """A complete GpuRecommendation: the fields the report reads, the others at their zero values."""
    ns, kind = _IDLE_TEAMS[team]
    action, target = _ACTIONS[i % len(_ACTIONS)]
    hours = 3.0 + i % 5 * 7.5  # streaks of 3 to 33 h: some span two or three days
    rec: dict[str, Any] = {
        "recommendation_id": f"r{i}", "sequence": 1, "status": "firing" if i % 3 else "resolved",
        "namespace": ns, "pod": f"{ns}-{i}", "owner_kind": kind, "owner_name": f"{ns}-o{i % 7}",
        "team": team, "labels": {"team": team}, "idle_since_ms": start,
        "last_seen_ms": start + int(hours * H), "timestamp_ms": start + int(hours * H),
        "gpu_hours_idle": hours, "cost_wasted": hours * 2.5,
        "currency": "USD", "action": action, "target": target, "saving_per_hour": 1.25 if target else 2.5,
    }  # fmt: skip
    schema = json.loads((REPO / "schemas" / "GpuRecommendation.avsc").read_text())
    for f in schema["fields"]:
        if f["name"] in rec:
            continue
        t = f["type"]
        if "default" in f:
            rec[f["name"]] = f["default"]
        elif isinstance(t, list) and "null" in t:
            rec[f["name"]] = None
        elif isinstance(t, dict) and t.get("type") == "enum":
            rec[f["name"]] = t["symbols"][0]
        else:
            base = t["type"] if isinstance(t, dict) else t
            rec[f["name"]] = {"string": "", "long": 0, "int": 0, "double": 0.0, "boolean": False}[base]
    return rec


def test_idle_report_renders_in_chromium(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    day0 = (int(time.time() * 1000) // DAY - 4) * DAY
    records = [
        _recommendation(i, team, day0 + (i % 3) * DAY + i * H)
        for i, team in enumerate(["serving", "ml", "research", "ml", "serving", "ml"] * 4)
    ]
    ensure_topics(kafka, [topics.RECOMMENDATIONS], prefix=topic_prefix)
    enc = AvroCodec().encoder("GpuRecommendation")
    prod = Producer({"bootstrap.servers": kafka, "enable.idempotence": True})
    for r in records:
        prod.produce(topics.with_prefix(topic_prefix, topics.RECOMMENDATIONS), enc.encode(r), key=r["pod"])
    assert prod.flush(30) == 0
    res = gpupipe(
        "report", "idle", "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix,
        "--format", "html", "--by", "team", "--since", "30d", timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    page = tmp_path / "idle.html"
    page.write_text(res.stdout)

    png = tmp_path / "idle.png"
    screenshot(page, png, tmp_path / "profile")
    distinct, dominant = colour_stats(png)
    assert distinct > 50 and dominant < 0.9, (distinct, dominant)
    with Image.open(png) as img:
        seen = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 24)}
    assert _hex(PALETTE[0]) in seen and _hex(PALETTE[1]) in seen  # the chart's bars were drawn

    dom = dump_dom(page, tmp_path / "profile")
    hours = sum(r["gpu_hours_idle"] for r in records)
    assert f'<div class="v" id="total-idle">{hours:,.2f}</div>' in dom
    assert f'<div class="v" id="total-wasted">{hours * 2.5:,.2f} USD</div>' in dom
    opened = [r for r in records if r["status"] == "firing"]
    assert f'id="total-open">{len(opened)} of {len(records)}</div>' in dom
    saving = sum(r["saving_per_hour"] for r in opened)
    assert f'<div class="v" id="total-saving">{saving:,.2f} USD</div>' in dom
    first = min(r["idle_since_ms"] for r in records)
    last = max(r["last_seen_ms"] for r in records)
    span = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(first / 1000))} to "
    span += f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(last / 1000))} UTC"
    assert span in dom  # the data's own span, not the --since cut-off
    for team in _IDLE_TEAMS:
        assert f'data-group="{team}"' in dom
    for action, _ in _ACTIONS:  # each suggestion explained in the contract's words
        assert f'data-action="{action}"' in dom
    assert "free it" in dom and "time-sliced replica" in dom
    owners = {(r["namespace"], r["owner_name"]) for r in records}
    assert len(owners) > 10 and dom.count('data-owner="') == 10  # the ten owners that waste most
    assert dom.count("<rect ") > 3 * 4  # a bar per day, stacked by team
    pdf = print_pdf(page, tmp_path / "idle.pdf", tmp_path / "profile")
    pages = len(re.findall(rb"/Type\s*/Page\b", pdf))
    assert pdf.startswith(b"%PDF") and 1 <= pages <= 6, pages


@pytest.mark.parametrize("by", ["owner", "team"])
def test_idle_page_fits_its_window_with_the_demos_names(tmp_path: Path, by: str) -> None:
    """Owners and targets as the demo writes them (long, with no space to break at) stay within the
    page: nothing scrolls sideways, and no column is cut off on screen."""
    start = (int(time.time() * 1000) // DAY - 1) * DAY
    records = []
    for i, (action, target) in enumerate(
        [("right_size_mig", "1g.35gb"), ("shared_gpu", "nvidia.com/gpu.shared"), ("release", None)] * 4
    ):
        rec = _recommendation(i, "research", start + i * H)
        rec.update(namespace="notebooks", owner_kind="Notebook", owner_name=f"notebook-{i:05x}1c76b")
        rec.update(pod=f"notebook-{i:05x}1c76b-a3063220", action=action, target=target)
        records.append(rec)
    rows = build_idle_report(records, by=by)
    page = tmp_path / "idle.html"
    page.write_text(render_idle_html(rows, records, since_ms=start), encoding="utf-8")
    assert page.read_text().count("notebooks/Notebook/notebook-") >= 10  # the long owner names are there
    for window in (1280, 1000):
        document, seen = page_width(page, tmp_path / "profile", window)
        assert document <= seen, f"{window} px window: the page is {document} px wide"
