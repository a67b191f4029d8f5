"""The Prometheus alerting rules and the Alertmanager config in deploy/ are valid and do what they say.

Runs the real tools (Debian packages prometheus and prometheus-alertmanager): `promtool check rules`,
`promtool test rules` with the unit-test file next to the rules, `amtool check-config`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO

pytestmark = pytest.mark.integration

REPO = REPO
RULES = REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.yml"
FAULT_RULES = REPO / "deploy" / "prometheus" / "gpupipe-faults.rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.test.yml"
AM_CONFIG = REPO / "deploy" / "alertmanager" / "alertmanager.yml"


def tool(name: str) -> str:
    if name == "promtool3":  # Prometheus 3's, built from its Go module (scripts/prometheus3-local)
        from tests.integration.metrics_helpers import prometheus3

        return prometheus3()[1]
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing (apt-get install prometheus prometheus-alertmanager)", pytrace=False)
    return path


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=RULES.parent)


PROMTOOLS = pytest.mark.parametrize("promtool", ["promtool", "promtool3"], ids=["2.42", "3"])


@PROMTOOLS
def test_promtool_check_rules(promtool: str) -> None:
    res = run(tool(promtool), "check", "rules", str(RULES), str(FAULT_RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@PROMTOOLS
def test_promtool_unit_tests_for_rules(promtool: str) -> None:
    res = run(tool(promtool), "test", "rules", str(RULE_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_shipped_prometheus_config_passes_prometheus_3s_check() -> None:
    config = REPO / "deploy" / "prometheus" / "prometheus.yml"
    res = run(tool("promtool3"), "check", "config", str(config))
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_with_the_4_8_3_hostname_label(tmp_path: Path) -> None:
    """The same rule tests with dcgm-exporter 4.8.3's ``hostname`` label instead of ``Hostname``
    (``gpupipe metrics --host-label hostname``): every alert fires with the same labels and names the
    host in its summary. Before, two summaries printed ``{{ $labels.Hostname }}`` only (empty host)."""
    text = RULE_TESTS.read_text()
    assert text.count('Hostname="') > 10 and text.count("Hostname: ") > 10
    for rules in (RULES, FAULT_RULES):
        (tmp_path / rules.name).write_text(rules.read_text())
    variant = tmp_path / RULE_TESTS.name
    variant.write_text(text.replace('Hostname="', 'hostname="').replace("Hostname: ", "hostname: "))
    res = subprocess.run(
        [tool("promtool"), "test", "rules", str(variant)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_rule_has_severity_action_and_runbook() -> None:
    groups = [g for f in (RULES, FAULT_RULES) for g in yaml.safe_load(f.read_text())["groups"]]
    names = []
    for group in groups:
        for rule in group["rules"]:
            names.append(rule["alert"])
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
            assert rule["labels"]["action"], rule["alert"]
            assert rule["labels"]["drain_node"] in ("true", "false"), rule["alert"]
            for key in ("summary", "description", "runbook"):
                assert rule["annotations"].get(key), f"{rule['alert']} lacks {key}"
    tested = RULE_TESTS.read_text()
    untested = [n for n in names if f"alertname: {n}\n" not in tested]
    assert not untested, f"rules without a promtool test: {untested}"


def test_alertmanager_config_is_valid() -> None:
    res = run(tool("amtool"), "check-config", str(AM_CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr
    route = yaml.safe_load(AM_CONFIG.read_text())["route"]
    assert route["group_by"] == ["alertname", "node"]
