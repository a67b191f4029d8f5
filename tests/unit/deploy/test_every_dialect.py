"""Our shipped rules and dashboards read every naming generation of dcgm-exporter (pure).

Each read of a field that dcgm-exporter renamed, in every rule expression of
deploy/prometheus/*.rules.yml and every panel query and variable of deploy/grafana/dashboards/,
must be in the form the mapping table derives (consumers/metrics/dialect_promql.py), and name the
field under each of its names. Before, they read 4.8's names only, so under ``--dialect dcgm-4.9``
or ``dcgm-4.10`` alone the rules and panels on renamed fields found nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from gpupipe_consumers.metrics import dialect, fields
from gpupipe_consumers.metrics.dialect_promql import every_generation, every_generation_match
from gpupipe_consumers.metrics.fields import Kind
from tests.paths import REPO

RULE_FILES = sorted((REPO / "deploy" / "prometheus").glob("*.rules.yml"))
DASHBOARDS = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
SCRIPT = REPO / "deploy" / "prometheus" / "every_dialect.py"
METRIC_RENAMES = [r for r in dialect.RENAMES if fields.BY_NAME[r.old].kind is not Kind.LABEL]
_WORD = re.compile(r"\b[A-Z][A-Z0-9_]+\b")


def rule_exprs() -> list[tuple[str, str]]:
    return [
        (f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"])
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in doc["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def panel_exprs() -> list[tuple[str, str]]:
    docs = {p.name: json.loads(p.read_text()) for p in DASHBOARDS}
    return [
        (f"{name}: {p['title']} [{t['refId']}]", t["expr"])
        for name, doc in docs.items()
        for p in _panels(doc)
        for t in p.get("targets", [])
    ]


def variable_selectors() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["query"])
                assert m, var["query"]
                out.append((f"{path.name}: ${var['name']}", m.group(1)))
    return out


def one_generation_only(text: str) -> list[str]:
    """The renamed metrics ``text`` names without their other name (a plain check of names,
    independent of the rewrite's form)."""
    words = set(_WORD.findall(text))
    return [
        f"{r.old} without {r.new}" if r.old in words else f"{r.new} without {r.old}"
        for r in METRIC_RENAMES
        if (r.old in words) != (r.new in words)
    ]


def test_the_shipped_files_read_renamed_fields() -> None:
    """The checks below have something to check: rules and panels on renamed fields."""
    rules = " ".join(e for _, e in rule_exprs())
    panels = " ".join(e for _, e in panel_exprs())
    assert {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ROW_REMAP_FAILURE"} <= set(
        _WORD.findall(rules)
    )
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE"} <= set(
        _WORD.findall(panels)
    )
    assert len(variable_selectors()) >= 3


@pytest.mark.parametrize(("where", "expr"), rule_exprs() + panel_exprs(), ids=lambda v: v[:60])
def test_each_rule_and_panel_reads_every_generation(where: str, expr: str) -> None:
    assert one_generation_only(expr) == [], where
    assert every_generation(expr) == expr, f"{where}: not in its every-generation form"


@pytest.mark.parametrize(("where", "selector"), variable_selectors())
def test_each_variable_offers_values_under_every_generation(where: str, selector: str) -> None:
    assert one_generation_only(selector) == [], where
    assert every_generation_match(selector) == selector, where


def test_the_check_fails_on_a_rule_in_one_generation(tmp_path) -> None:
    """The script's check names a rule written with 4.8's names only; its rewrite fixes it and
    touches nothing but the expressions."""
    text = (
        "# a hot GPU: DCGM_FI_DEV_GPU_TEMP\n"
        "groups:\n"
        "  - name: g\n"
        "    rules:\n"
        "      - alert: Hot\n"
        "        expr: DCGM_FI_DEV_GPU_TEMP > 85\n"
        "        annotations:\n"
        '          summary: "DCGM_FI_DEV_GPU_TEMP is {{ $value }}"\n'
        "      - alert: Idle\n"
        "        expr: |\n"
        "          max_over_time(DCGM_FI_DEV_GPU_UTIL[10m]) < 5\n"
        "            and DCGM_FI_DEV_FB_USED > 0\n"
    )
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import every_dialect  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert every_dialect.stale_rules(text) == ["Hot", "Idle"]
    fixed = every_dialect.rewrite(text)
    assert every_dialect.stale_rules(fixed) == []
    old_rules = yaml.safe_load(text)["groups"][0]["rules"]
    new_rules = yaml.safe_load(fixed)["groups"][0]["rules"]
    assert [every_generation(r["expr"]) for r in old_rules] == [r["expr"] for r in new_rules]
    assert [r["annotations"] for r in new_rules if "annotations" in r] == [old_rules[0]["annotations"]]
    assert fixed.splitlines()[0] == text.splitlines()[0]


def test_the_script_checks_the_shipped_rules() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
