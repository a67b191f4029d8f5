"""The Prometheus XID rules (gpupipe-faults.rules.yml, for setups without ``gpupipe alerts``) agree
with the pinned catalog, code by code.

Each XID rule selects codes with one PromQL label matcher on ``xid`` (``=``, ``=~`` or ``!~``; PromQL
regexes are fully anchored). For every catalog code and an unknown one: an info code raises nothing, any
other code exactly one rule, whose severity and drain_node are the catalog row's (unknown codes: warning,
no drain, like the classifier's safe default). ``promtool test rules`` (tests/integration/
test_alerts_rules.py) checks that the rules evaluate as written; this checks what they select.
"""

from __future__ import annotations

import re

import yaml

from gpupipe_consumers.alerts.rules.catalog import entries
from tests.paths import REPO

RULES = REPO / "deploy" / "prometheus" / "gpupipe-faults.rules.yml"
_MATCHER = re.compile(r'DCGM_EXP_XID_ERRORS_TOTAL\{xid(=~|!~|=)"([^"]*)"\}')


def _xid_rules() -> list[tuple[str, str, str, dict[str, str]]]:
    doc = yaml.safe_load(RULES.read_text())
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            m = _MATCHER.search(rule.get("expr", ""))
            if m:
                out.append((rule["alert"], m[1], m[2], rule["labels"]))
    return out


def _selects(op: str, value: str, code: int) -> bool:
    text = str(code)
    if op == "=":
        return text == value
    hit = re.fullmatch(value, text) is not None
    return hit if op == "=~" else not hit


def test_every_catalog_code_meets_the_rule_the_catalog_implies() -> None:
    rules = _xid_rules()
    assert len(rules) >= 6
    wrong = []
    for info in [*entries("xid"), None]:
        code = info.code if info is not None else 999  # not in the catalog
        hits = [(name, labels) for name, op, value, labels in rules if _selects(op, value, code)]
        severity = info.severity.value if info is not None else "warning"
        drain = info.drain_node if info is not None else False
        if severity == "info":
            if hits:
                wrong.append(f"{code}: info in the catalog but raises {[h[0] for h in hits]}")
            continue
        if len(hits) != 1:
            wrong.append(f"{code}: {len(hits)} rules ({[h[0] for h in hits]})")
            continue
        name, labels = hits[0]
        if (labels["severity"], labels["drain_node"]) != (severity, "true" if drain else "false"):
            wrong.append(
                f"{code}: {name} says {labels['severity']}/{labels['drain_node']}, catalog {severity}/{drain}"
            )
    assert not wrong, "\n".join(wrong)
