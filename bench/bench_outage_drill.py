"""Benchmark drill: the issue's outage, kill -9 of the broker for 30 s with every service up.

Run: ``.venv/bin/python bench/bench_outage_drill.py [DOWN_S] [RUN_S]`` (about 3 minutes; starts
its own broker on a free port: the drill kills it). The same drill as
tests/integration/test_drills.py (start before the broker and its topics, kill -9 under load,
restart, restart each consumer in turn) with the full 30 s outage and a longer run.

Prints the figures (time to recover per service, shutdown times, records lost/duplicated) and
ratio lines: ``outage_drill_records_kept`` = 1.0 when nothing was lost or counted twice (target
1.00), ``outage_drill_shutdown`` = 10 s / slowest SIGTERM-to-exit (target 1.00: every service
stops within its 10 s budget).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import ratio_line

from tests.integration.drill import run_drill


def main() -> int:
    down_s = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    run_s = int(sys.argv[2]) if len(sys.argv) > 2 else 120
    with tempfile.TemporaryDirectory(prefix="gpupipe-drill-") as tmp:
        fig = run_drill(Path(tmp), down_s=down_s, run_s=run_s)
    for line in fig.lines():
        print(f"  {line}")
    bad = (
        fig.xids_lost
        + fig.xids_duplicated
        + fig.samples_miscounted
        + fig.alert_occurrences_lost
        + fig.alert_records_duplicated
    )
    ratio_line("outage_drill_records_kept", 1.0 if bad == 0 and not fig.notes else 0.0, 1.0)
    slowest = max(fig.shutdown_s.values() or [0.01])
    ratio_line("outage_drill_shutdown", 10.0 / max(slowest, 0.01), 1.0)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
