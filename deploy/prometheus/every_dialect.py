"""Make every expression of the shipped rule files read every dcgm-exporter naming generation.

The rule files are their own source: write a rule with dcgm-exporter 4.8's names, then run this to
turn each read of a renamed field into a read of either name in the 4.8 unit (the rewrite and its
table: consumers/metrics/dialect_promql.py), so the rules work under any ``gpupipe metrics
--dialect``. Only the ``expr`` lines change; comments and the rest stay as written. ``--check``
writes nothing and exits 1 naming the rules that are not in that form.

    .venv/bin/python deploy/prometheus/every_dialect.py [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gpupipe_consumers.metrics.dialect_promql import every_generation  # noqa: E402

RULE_FILES = sorted((REPO / "deploy" / "prometheus").glob("*.rules.yml"))
_EXPR = re.compile(r"^(\s*)expr:(\s*)(.*)$")


def rewrite(text: str) -> str:
    """The rule file ``text`` with every ``expr`` (a one-line plain scalar or a ``|`` block, one
    read per line at most) in its every-generation form."""
    lines = text.split("\n")
    out: list[str] = []
    block_indent: int | None = None  # indentation of the expr key while inside its block
    for line in lines:
        if block_indent is not None:
            if line.strip() and len(line) - len(line.lstrip()) <= block_indent:
                block_indent = None
            else:
                out.append(every_generation(line))
                continue
        m = _EXPR.match(line)
        if m is None:
            out.append(line)
        elif m.group(3) in ("|", "|-", ">", ">-"):
            block_indent = len(m.group(1))
            out.append(line)
        else:
            out.append(f"{m.group(1)}expr:{m.group(2)}{every_generation(m.group(3))}")
    return "\n".join(out)


def stale_rules(text: str) -> list[str]:
    """Names of the rules whose expression is not in its every-generation form."""
    return [
        rule.get("alert") or rule.get("record")
        for group in yaml.safe_load(text)["groups"]
        for rule in group["rules"]
        if every_generation(rule["expr"]) != rule["expr"]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Make the rule files read every naming generation.")
    ap.add_argument("--check", action="store_true", help="compare only, write nothing")
    args = ap.parse_args(argv)
    failed = []
    for path in RULE_FILES:
        text = path.read_text()
        if args.check:
            failed += [f"{path.name}: {name}" for name in stale_rules(text)]
            continue
        new = rewrite(text)
        if stale := stale_rules(new):
            failed += [f"{path.name}: {name} (not rewritable line by line)" for name in stale]
            continue
        if new != text:
            path.write_text(new)
    if failed:
        print("rules reading one generation only: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
