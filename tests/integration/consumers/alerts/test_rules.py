"""The Prometheus alerting rules and the Alertmanager config in deploy/ are valid and do what they say.

Runs the real tools (Debian packages prometheus and prometheus-alertmanager): `promtool check rules`,
`promtool test rules` with the unit-test file next to the rules, `amtool check-config`. The rule
tests run as written (dcgm-exporter 4.8's names) and with their input series as each other
`gpupipe metrics --dialect` serves them: the same alerts fire.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpupipe_consumers.metrics import dialect
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


_SERIES = re.compile(r"^(\s*- series: ')([A-Za-z_:][A-Za-z0-9_:]*)(.*)$")


def rule_tests_in(text: str, which: str) -> str:
    """The rule tests with each input series of a renamed field under the names ``--dialect
    which`` serves: one series per generation, values as they are. Metric names only: no rule
    reads the driver-version label, and the restart case holds both of its names."""
    gens = dialect.generations(which)
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _SERIES.match(lines[i])
        r = dialect.BY_OLD.get(m.group(2)) if m else None
        if m is None or r is None:
            out.append(lines[i])
            i += 1
            continue
        assert not r.unit_change, f"{r.old}: convert its values to {r.new}'s unit here"
        values = lines[i + 1]
        assert values.lstrip().startswith("values:"), values
        for name in dict.fromkeys(dialect.name_in(r, g) for g in gens):
            out += [f"{m.group(1)}{name}{m.group(3)}", values]
        i += 2
    return "\n".join(out)


@PROMTOOLS
@pytest.mark.parametrize("which", [*dialect.GENERATIONS[1:], "both"])
def test_promtool_unit_tests_in_each_dialect(promtool: str, which: str, tmp_path: Path) -> None:
    """Every rule test, its input series in the names of ``--dialect which``: the same alerts, with
    the same labels and values, fire (under ``both`` once each, not once per name). Before, the
    rules read 4.8's names only: under dcgm-4.9 or dcgm-4.10 the rules on renamed fields (hot GPU,
    remapped rows, missing GPU, last XID, row-remap failure) stayed silent and GpuMetricsAbsent fired."""
    text = RULE_TESTS.read_text()
    variant = rule_tests_in(text, which)
    renamed = {r.old for r in dialect.RENAMES} & set(re.findall(r"series: '(\w+)", text))
    assert {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ROW_REMAP_FAILURE"} <= renamed
    served = re.findall(r"series: '(\w+)", variant)
    for old in renamed:
        r = dialect.BY_OLD[old]
        assert (old in served) == ("dcgm-4.8" in dialect.generations(which)), (which, old)
        assert r.new in served, (which, r.new)
    for rules in (RULES, FAULT_RULES):
        (tmp_path / rules.name).write_text(rules.read_text())
    (tmp_path / RULE_TESTS.name).write_text(variant)
    res = subprocess.run(
        [tool(promtool), "test", "rules", RULE_TESTS.name],
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
