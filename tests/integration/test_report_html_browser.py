"""`gpupipe report chargeback --format html` end to end: real broker, real CLI, real headless chromium.

Chargeback windows of the simulated fleet (accounted in-process by the chargeback engine) go to a
real topic; the real CLI writes the page; Debian's chromium renders it. The screenshot must not be
blank (many colours, no colour filling almost everything, the chart's team colours present) and
the DOM chromium built must hold the totals the report rows add up to.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Producer
from PIL import Image

from consumers.report.chargeback_report import build_report
from consumers.report.html_report import PALETTE
from gpupipe import topics
from gpupipe.kafka_admin import ensure_topics
from gpupipe.teams import parse_team_map
from schemas.codec import AvroCodec
from scripts.report_example_data import EXAMPLE_TEAMS, simulated_windows
from tests.integration.browser_util import colour_stats, dump_dom, print_pdf, screenshot
from tests.integration.kafka_util import gpupipe

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
    assert dom.count("<rect ") > 6 * 3  # six stacked bars of several teams

    # Print-friendly: chromium prints it to a few pages (the 6 h x teams table spills over).
    pdf = print_pdf(page, tmp_path / "report.pdf", tmp_path / "profile")
    pages = len(re.findall(rb"/Type\s*/Page\b", pdf))
    assert pdf.startswith(b"%PDF") and 1 <= pages <= 20, pages
