"""Start-order, outage and restart drills (see tests/integration/drill.py; bench/bench_outage_drill.py
runs the 30 s outage). Services start before the broker and its topics exist, the broker is killed
with SIGKILL under load and restarted, each consumer is restarted in turn: nothing may be lost,
nothing counted twice, and every service must stop within its 10 s shutdown budget."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.drill import run_drill

pytestmark = pytest.mark.integration


def test_start_order_outage_and_restart_drill(tmp_path: Path) -> None:
    fig = run_drill(tmp_path, down_s=8, run_s=60)
    print("\n".join(fig.lines()))
    assert fig.xids_expected > 10, "the drill must carry XIDs"
    assert fig.xids_lost == 0 and fig.xids_duplicated == 0
    assert fig.samples_checked > 0 and fig.samples_miscounted == 0
    assert fig.alert_gpus > 0 and fig.alert_occurrences_lost == 0
    assert fig.alert_records_duplicated == 0
    assert not fig.notes, fig.notes
    assert all(s <= 10.0 for s in fig.shutdown_s.values()), fig.shutdown_s
    # broker down: every consumer is gone within its 10 s budget (+1 s for the process to exit)
    assert len(fig.shutdown_broker_down_s) == 3
    assert all(s <= 11.0 for s in fig.shutdown_broker_down_s.values()), fig.shutdown_broker_down_s
    assert all(rc in (0, 1) for rc in fig.shutdown_broker_down_rc.values()), fig.shutdown_broker_down_rc
    # the producer stopped with the broker down: one line saying what it dropped, exit 1
    assert fig.producer_stop_rc == 1
    assert re.fullmatch(
        r"gpupipe produce: error: stopped with records undelivered: \d+ samples dropped, \d+ XIDs dropped",
        fig.producer_stop_line,
    ), fig.producer_stop_line
