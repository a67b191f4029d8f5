"""Write an example HTML chargeback report from the simulated fleet, with no broker.

Used for ``docs/chargeback-report.png``; prints the path it wrote. Screenshot it with
``chromium --headless --no-sandbox --hide-scrollbars --window-size=1000,1400 --screenshot=OUT.png file://$PWD/OUT.html``.

    .venv/bin/python scripts/report_example.py OUT.html [--hours 24] [--period hour]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpupipe.domain.teams import parse_team_map
from gpupipe_consumers.report.chargeback_report import build_report
from gpupipe_consumers.report.formats import render_report
from scripts.report_example_data import EXAMPLE_TEAMS, simulated_windows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write an example HTML chargeback report.")
    ap.add_argument("out", type=Path)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--period", default="hour", choices=("window", "hour", "day"))
    args = ap.parse_args(argv)
    teams = parse_team_map(EXAMPLE_TEAMS)
    rows = build_report(simulated_windows(args.hours), by=("team",), teams=teams, period=args.period)
    args.out.write_text(render_report(rows, "html"))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
