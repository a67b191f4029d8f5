"""STAGING: the deployed system as real processes through the issue's fault schedule, then audited.

The harness of ``tests/staging.py`` (its short drill is in ``make test``) with 3 simulated nodes of 2
GPUs: 3 KRaft brokers, node agents through the real entry point (NVML double, kmsg relay over a fake
kernel log, kubelet double), 2 metrics replicas, 2 chargeback instances, the alerts HA pair, a real
Alertmanager (shipped config) and a real Prometheus (shipped config and rules). Schedule, each step
awaited until the whole system is ready again (every process ready, Prometheus seeing every GPU, an
alerts leader):

1. an Xid 79 (a drain) and its page;
2. the leader of partition 0 of samples, XIDs and chargeback SIGKILLed in turn, an Xid 13 while the
   XID leader is down, the broker restarted on its data;
3. a broker paused (SIGSTOP) ``GPUPIPE_STAGING_PAUSE_S`` (15) seconds, then resumed;
4. a rolling restart of all brokers (clean stop, start, every partition back in sync before the next);
5. every service SIGKILLed and restarted in turn (an Xid 31 while the alerts leader is dead; the
   killed leader comes back once the standby leads);
6. a node agent SIGKILLed, an Xid 31 written to its kernel log while it is down, restarted;
7. Prometheus SIGKILLed and restarted.

Lines: ``staging_paged_once`` (faults paged exactly once / faults), ``staging_no_false_page`` and
``staging_no_false_cordon`` (1 / (1 + each violation)), ``staging_prometheus_gpus`` (GPUs Prometheus
sees / GPUs), ``staging_chargeback_exact`` (1 / (1 + samples miscounted)), ``staging_recovery``
(the budget ``GPUPIPE_STAGING_RECOVERY_S``, 120 s, over the slowest recovery: >= 1 within budget; a
recovery runs from the fault to the whole system ready again, the restart of what broke included).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable

from common import REPO, figure, ratio_line

sys.path.insert(0, str(REPO))
from gpupipe.kafka import topics  # after the root is on the path
from tests.staging import Staging, await_event

PAUSE_S = float(os.environ.get("GPUPIPE_STAGING_PAUSE_S", "15"))
BUDGET_S = float(os.environ.get("GPUPIPE_STAGING_RECOVERY_S", "120"))
RUN_DIR = REPO / ".run" / "bench-staging"  # every process' log, kept for the post-mortem


def main() -> int:
    t_all = time.monotonic()
    recovery: dict[str, float] = {}
    notes: list[str] = []
    shutil.rmtree(RUN_DIR, ignore_errors=True)  # the last run's logs stay until the next run
    s = Staging(RUN_DIR, nodes=3, gpus=2)
    try:
        s.start()
        figure("start", s.timings["start_s"], "s")
        figure("prometheus_major", s.prom_version)

        def step(name: str, fault: Callable[[], None]) -> None:
            """Run one fault (it restarts what it broke), then time the whole system's recovery."""
            t0 = time.monotonic()
            try:
                fault()
                s.await_ready(300)
                recovery[name] = time.monotonic() - t0
            except AssertionError as exc:
                notes.append(f"{name}: {str(exc)[:300]}")
                recovery[name] = float("inf")
            figure(f"recovery_{name}", recovery[name], "s")

        f79 = s.inject_xid(0, 0, 79)
        t = time.monotonic()
        await_event("the Xid 79 paged", lambda: any(s._matches(f79, dict(k)) for k in s.pages()), 60)
        figure("page_latency_xid79", time.monotonic() - t, "s")

        for base in (topics.SAMPLES, topics.XID, topics.CHARGEBACK):

            def leader_kill(base: str = base) -> None:
                node = s.kill_leader(base)
                if base == topics.XID:
                    s.inject_xid(1, 0, 13)
                s.start_broker(node)

            step(f"leader_{base.split('.')[1]}", leader_kill)

        def pause() -> None:
            node = s.leader(topics.SAMPLES)
            s.pause_broker(node)
            time.sleep(PAUSE_S)  # the fault itself is a length of time
            s.resume_broker(node)

        step("broker_pause", pause)

        def rolling() -> None:
            for node in (1, 2, 3):
                s.stop_broker(node)
                s.start_broker(node)
                await_event("every partition in sync", s.in_sync, 180, 1.0)

        step("rolling_brokers", rolling)

        for name in ("metrics-a", "metrics-b", "chargeback-a", "chargeback-b"):
            step(f"kill_{name}", lambda name=name: (s.kill(name), s.restart(name)))

        def standby_kill() -> None:
            leader = s.alerts_leader()
            other = "alerts-b" if leader == "alerts-a" else "alerts-a"
            s.kill(other)
            s.restart(other)

        step("kill_alerts_standby", standby_kill)

        def leader_kill_alerts() -> None:
            leader = s.alerts_leader()
            assert leader is not None
            s.kill(leader)
            s.inject_xid(2, 0, 31)
            recovery["alerts_takeover"] = s.await_takeover(leader)
            s.restart(leader)

        step("kill_alerts_leader", leader_kill_alerts)

        def agent_restart() -> None:
            s.kill("gpu-node-1")
            s.inject_xid(1, 1, 31)  # written while the agent is down: read from its cursor
            s.restart("gpu-node-1")

        step("node_agent_restart", agent_restart)

        def prometheus_restart() -> None:
            assert s.prom is not None
            s.prom.kill9()
            s.prom.start()

        step("prometheus_restart", prometheus_restart)

        audit = s.audit(180)
    finally:
        s.close()
    for k, v in audit.__dict__.items():
        if k != "violations":
            figure(k, v if not isinstance(v, (list, dict)) else str(v))
    for v in audit.violations + notes:
        print(f"  violation: {v}", flush=True)
    figure("alerts_takeover", recovery.get("alerts_takeover", float("nan")), "s")
    figure("wall", time.monotonic() - t_all, "s")
    worst = max(recovery.values(), default=float("inf"))
    lines = [
        ratio_line("staging_paged_once", audit.paged_once / max(1, audit.faults), 1.0),
        ratio_line("staging_no_false_page", 1 / (1 + len(audit.false_pages)), 1.0),
        ratio_line(
            "staging_no_false_cordon", 1 / (1 + len(audit.false_cordons) + len(audit.missing_cordons)), 1.0
        ),
        ratio_line("staging_prometheus_gpus", audit.gpus_in_prometheus / max(1, audit.gpus_expected), 1.0),
        ratio_line("staging_chargeback_exact", 1 / (1 + audit.samples_miscounted), 1.0),
        ratio_line("staging_recovery", BUDGET_S / worst if worst > 0 else 0.0, 1.0),
    ]
    return 1 if notes or audit.violations or any("BELOW" in ln for ln in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
