"""The migration page (docs/migrate.md) cannot drift from what it describes.

- Its chart table names only values that exist: the gpupipe column in deploy/helm/gpupipe/values.yaml,
  the dcgm-exporter column in NVIDIA's chart values (a copy of its ``deployment/values.yaml`` at main
  ``d5e5f51``: tests/fixtures/metrics/dcgm-exporter/chart-values.yaml), and every top-level value of
  NVIDIA's chart has a row, so a reader coming from it finds each of theirs.
- Its topic table is gpupipe's topic defaults (gpupipe/kafka/topics.py and the alerts lease topic).
- Every ```promql block parses (``promtool check rules``: each block becomes a recording rule, the only
  way promtool checks a bare expression) and the comparison queries give the answers the page
  promises on a small pilot (``promtool test rules``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupipe.kafka import topics
from gpupipe_consumers.alerts import leader
from tests.paths import FIXTURES, REPO

PAGE = REPO / "docs" / "migrate.md"
OUR_VALUES = REPO / "deploy" / "helm" / "gpupipe" / "values.yaml"
NVIDIA_VALUES = FIXTURES / "metrics" / "dcgm-exporter" / "chart-values.yaml"
MAPPINGS = {"same", "different", "n/a"}
NONE = "—"

_SPAN = re.compile(r"`([^`]+)`")
_PROMQL = re.compile(r"^```promql\n(.*?)^```", re.M | re.S)


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with `header_start`."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def has_path(values: Any, dotted: str) -> bool:
    node = values
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def chart_rows() -> list[list[str]]:
    text = section(PAGE.read_text(encoding="utf-8"), "NVIDIA's chart values, mapped")
    return table_rows(text, "| dcgm-exporter value |")


def test_the_chart_table_names_only_values_of_our_chart() -> None:
    ours = yaml.safe_load(OUR_VALUES.read_text(encoding="utf-8"))
    rows = chart_rows()
    assert len(rows) >= 30, rows  # the parse sees the table
    bad = []
    for theirs, gpupipe, mapping, _notes in rows:
        assert mapping in MAPPINGS, f"{theirs}: mapping {mapping!r}, use one of {sorted(MAPPINGS)}"
        named = _SPAN.findall(gpupipe)
        assert (mapping == "n/a") == (gpupipe == NONE), f"{theirs}: n/a rows, and only they, name none"
        assert named or gpupipe == NONE, f"{theirs}: name the values in `code`"
        bad += [f"{theirs} -> {path}" for path in named if not has_path(ours, path)]
    assert not bad, "not in deploy/helm/gpupipe/values.yaml:\n" + "\n".join(bad)


def nvidia_values() -> tuple[dict[str, Any], set[str]]:
    """NVIDIA's values, and the top-level keys its file documents only in a comment (customMetrics)."""
    text = NVIDIA_VALUES.read_text(encoding="utf-8")
    commented = set(re.findall(r"^# ([A-Za-z]+): \|", text, re.M))
    return yaml.safe_load(text), commented


def test_the_chart_table_names_only_values_of_nvidias_chart_and_all_of_them() -> None:
    theirs, commented = nvidia_values()
    assert commented == {"customMetrics"}
    named = [path for row in chart_rows() for path in _SPAN.findall(row[0])]
    unknown = [p for p in named if not has_path(theirs, p) and p not in commented]
    assert not unknown, f"not in NVIDIA's chart values: {unknown}"
    unmapped = (set(theirs) | commented) - {p.split(".")[0] for p in named}
    assert not unmapped, f"NVIDIA's chart values without a row: {sorted(unmapped)}"


def test_the_drift_checks_see_a_value_that_does_not_exist() -> None:
    ours = yaml.safe_load(OUR_VALUES.read_text(encoding="utf-8"))
    assert has_path(ours, "producer.podMetadata.rbac.create")
    assert not has_path(ours, "producer.rbac.create")
    assert not has_path(ours, "metrics.flags.collectors")  # flags are an open map: name `metrics.flags`
    assert table_rows("x\n| a | b |\n|---|---|\n| `c` | d |\n\nafter", "| a |") == [["`c`", "d"]]


def test_the_topic_table_is_gpupipes_topic_defaults() -> None:
    text = section(PAGE.read_text(encoding="utf-8"), "Kafka on Kubernetes")
    rows = {r[0].strip("`"): r[1:] for r in table_rows(text, "| topic |")}
    specs = {**topics.DEFAULT_SPECS, leader.LEASE_TOPIC: leader._LEASE_SPEC}
    assert set(rows) == set(specs)
    for name, spec in specs.items():
        partitions, retention_ms, timestamp_type = rows[name]
        assert (int(partitions), int(retention_ms)) == (spec.partitions, spec.retention_ms), name
        assert timestamp_type == (spec.timestamp_type or "(broker default)"), name
        # the page says delete for every topic but the compacted ones, which it names
        assert spec.cleanup_policy == "delete" or f"`{name}`, which is compacted" in text, name


def page_promql() -> list[str]:
    found = _PROMQL.findall(PAGE.read_text(encoding="utf-8"))
    assert len(found) >= 8, found  # the scan sees the page's blocks
    return [block.strip() for block in found]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing (apt-get install prometheus)", pytrace=False)
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def rules_file(exprs: list[str]) -> dict[str, Any]:
    rules = [{"record": f"migrate_doc:expr_{i}", "expr": e} for i, e in enumerate(exprs)]
    return {"groups": [{"name": "docs-migrate", "rules": rules}]}


@pytest.mark.integration
def test_every_promql_on_the_page_parses(tmp_path: Path) -> None:
    path = tmp_path / "migrate.rules.yml"
    path.write_text(yaml.safe_dump(rules_file(page_promql()), sort_keys=False))
    res = run_promtool("check", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(page_promql())} rules found" in res.stdout


def test_the_parse_check_would_catch_a_broken_expression(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is missing")
    path = tmp_path / "broken.rules.yml"
    path.write_text(yaml.safe_dump(rules_file(["count by (__name__) ({job=~'x'}"])))
    res = run_promtool("check", "rules", str(path))
    assert res.returncode != 0


def find(exprs: list[str], *needles: str, first: str = "") -> str:
    """The one expression of the page holding every needle (and starting with `first`)."""
    (hit,) = [e for e in exprs if all(n in e for n in needles) and e.startswith(first)]
    return hit


@pytest.mark.integration
def test_the_comparison_queries_answer_what_the_page_says(tmp_path: Path) -> None:
    """A pilot in miniature: dcgm-exporter (GPU Operator job) and gpupipe see GPU-A; only
    dcgm-exporter sees GPU-B and serves a name gpupipe does not; GPU-A's utilisation is 40 on one
    side and 48 on the other. Each query of the page gives the answer its text promises."""
    exprs = page_promql()
    dcgm = 'job="nvidia-dcgm-exporter",instance="10.0.0.7:9400"'
    ours = 'job="gpupipe-metrics",instance="gpu-node-1",Hostname="gpu-node-1"'
    series = [
        (f'DCGM_FI_DEV_GPU_TEMP{{{dcgm},UUID="GPU-A",gpu="0"}}', "50x20"),
        (f'DCGM_FI_DEV_GPU_TEMP{{{dcgm},UUID="GPU-B",gpu="1"}}', "51x20"),
        (f'DCGM_FI_DEV_GPU_TEMP{{{ours},UUID="GPU-A",gpu="0"}}', "50x20"),
        (f'DCGM_FI_DEV_GPU_UTIL{{{dcgm},UUID="GPU-A",gpu="0"}}', "40x20"),
        (f'DCGM_FI_DEV_GPU_UTIL{{{ours},UUID="GPU-A",gpu="0"}}', "48x20"),
        (f'DCGM_FI_DEV_POWER_USAGE{{{dcgm},UUID="GPU-A",gpu="0"}}', "100x20"),
        (f'DCGM_FI_DEV_POWER_USAGE{{{ours},UUID="GPU-A",gpu="0"}}', "100x20"),
        (f'DCGM_FI_DEV_VGPU_LICENSE_STATUS{{{dcgm},UUID="GPU-A",gpu="0"}}', "0x20"),
    ]
    only_dcgm_names = find(exprs, "unless on (__name__)")
    count_differs = find(exprs, "!= on (")
    gpus_one_side = find(exprs, "unless on (UUID)")
    util_diff = find(exprs, "abs(", "[10m]", first="abs(")
    util_over_5 = find(exprs, "count(", "> 5")
    power_ratio = find(exprs, "sum(DCGM_FI_DEV_POWER_USAGE")
    per_name = find(exprs, "count by (job, __name__)")
    cases = [
        (only_dcgm_names, [("DCGM_FI_DEV_VGPU_LICENSE_STATUS", 1)]),
        (count_differs, [('{name="DCGM_FI_DEV_GPU_TEMP"}', 2)]),
        (gpus_one_side, [('{UUID="GPU-B"}', 1)]),
        (util_diff, [('{UUID="GPU-A"}', 8)]),
        (util_over_5, [("{}", 1)]),
        (power_ratio, [("{}", 1)]),
        (
            per_name,
            [
                ('DCGM_FI_DEV_GPU_TEMP{job="gpupipe-metrics"}', 1),
                ('DCGM_FI_DEV_GPU_TEMP{job="nvidia-dcgm-exporter"}', 2),
                ('DCGM_FI_DEV_GPU_UTIL{job="gpupipe-metrics"}', 1),
                ('DCGM_FI_DEV_GPU_UTIL{job="nvidia-dcgm-exporter"}', 1),
                ('DCGM_FI_DEV_POWER_USAGE{job="gpupipe-metrics"}', 1),
                ('DCGM_FI_DEV_POWER_USAGE{job="nvidia-dcgm-exporter"}', 1),
                ('DCGM_FI_DEV_VGPU_LICENSE_STATUS{job="nvidia-dcgm-exporter"}', 1),
            ],
        ),
    ]
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "15m",
                        "exp_samples": [{"labels": labels, "value": value} for labels, value in expected],
                    }
                    for expr, expected in cases
                ],
            }
        ],
    }
    path = tmp_path / "migrate.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    res = run_promtool("test", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
