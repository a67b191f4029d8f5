"""LIFE: 30 days of a cluster of 240 GPUs through the alerts service, against the ground truth.

The life drill of ``tests/life_drill.py`` (its short run is in ``make test``: two days of 104 GPUs)
at full length: hardware faults from NVIDIA's catalog with their recoveries by reset, reload and
reboot, application faults and job kills, producer restarts without a kernel-log cursor, broker
outages, per-node clock skew, and the service's own restarts and HA failovers every few hours, all in
accelerated time with the services' clocks injected, the cordons on the Kubernetes API double and the
pages in a simulated Alertmanager. ``GPUPIPE_DRILL_DAYS`` (30), ``GPUPIPE_DRILL_NODES`` (30, 8 GPUs
each) and ``GPUPIPE_DRILL_SEED`` (1) size it. ``GPUPIPE_DRILL_ALERTMANAGER=real`` posts the alerts to
the Debian ``prometheus-alertmanager`` instead and holds what it notified (tests/life_drill_am.py).

Figures: pages per hardware fault, false drains, lost drains, drained nodes uncordoned while broken,
RESOLVEDs while broken, lost XIDs (each is 0, or the number), and what the drill went through.

* ``life_drill_violations``: 1 / (1 + every violation counted); 1.00 is none.
* ``life_drill_paged_once``: hardware faults paged exactly once / hardware faults.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, figure, ratio_line

sys.path.insert(0, str(REPO))
from tests.k8s_api_fake import FakeKubeApi  # after the root is on the path
from tests.life_drill import Drill, DrillConfig, check, generate
from tests.life_drill_am import alertmanager_leg


def main() -> int:
    cfg = DrillConfig(
        seed=int(os.environ.get("GPUPIPE_DRILL_SEED", "1")),
        days=float(os.environ.get("GPUPIPE_DRILL_DAYS", "30")),
        nodes=int(os.environ.get("GPUPIPE_DRILL_NODES", "30")),
    )
    logging.disable(logging.WARNING)
    began = time.perf_counter()
    sc = generate(cfg)
    real = os.environ.get("GPUPIPE_DRILL_ALERTMANAGER", "sim") == "real"
    with FakeKubeApi(sc.nodes, token="tok") as api, tempfile.TemporaryDirectory() as d:
        if real:
            with alertmanager_leg(Path(d) / "am") as leg:
                drill = Drill(sc, api, Path(d), make_sender=leg.sender, on_step=leg.on_step).run()
                assert drill.inst is not None
                v = check(drill, leg.settle(drill.inst.sender))
        else:
            drill = Drill(sc, api, Path(d)).run()
            v = check(drill)
    bad = v.violations()
    print(
        f"life drill: {cfg.days:g} days, {cfg.nodes} nodes x {cfg.gpus_per_node} GPUs, seed {cfg.seed}, "
        f"{'real' if real else 'simulated'} Alertmanager, {time.perf_counter() - began:.0f} s"
    )
    for name, value in (
        ("hardware_faults", v.hardware_faults),
        ("paged_once", v.paged_once),
        ("pages_in_all", v.pages),
        ("xids", v.xids),
        ("xids_as_history", v.history_xids),
        ("cordons", v.cordons),
        ("refused_by_the_rate_limit", v.refused_by_limit),
        ("service_restarts_and_failovers", v.restarts),
        ("stuck_after_recovery", len(v.stuck_after_recovery)),
        ("pages_per_paged_fault", round(v.pages_per_fault(), 3)),
        *((f"violation_{k}", n) for k, n in bad.items()),
    ):
        figure(name, value)
    ratio_line("life_drill_violations", 1.0 / (1 + sum(bad.values())), 1.0)
    ratio_line("life_drill_paged_once", v.paged_once / v.hardware_faults if v.hardware_faults else 0.0, 1.0)
    return 0 if not any(bad.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
