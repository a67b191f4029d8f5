"""Benchmark: memory of the alerts service under a flood of XIDs for made-up GPUs.

Run: ``.venv/bin/python bench/bench_alerts_flood.py`` (about a minute).

Any GPU node may write an XidEvent for a UUID that does not exist, and each one opens an alert of
its own and state for its device (history, health, recovery evidence): 60k distinct UUIDs grew the
service with no bound and no line in its log. The service now keeps about ``--max-devices`` devices
and at most ``--max-open-alerts`` open alerts: while every device alerts, up to twice the device cap,
then the least recently seen alerting nodes are forgotten, counted (it never refuses a new one: see
:mod:`gpupipe_consumers.alerts.admission`).

The flood: 60k XidEvents (Xid 13, a warning that drains nothing), each for a new UUID on one of
5000 hosts (the adversarial run's shape), fed to :class:`~gpupipe_consumers.alerts.handler.AlertsHandler` in
batches of 500 with a timer tick every 5000 events; published records are counted, not kept. Each
variant runs in a child process of its own; RSS (``VmRSS``) is read before the flood, after 20k,
40k and 60k events, and the peak (``VmHWM``) at the end.

* ``alerts_flood_bounded``: ``--max-devices 10000 --max-open-alerts 20000``: 20k alerting devices
  at most, full after 20k events. From there on only the remembered event ids grow (up to
  ``EngineConfig.event_id_memory``, 200k): ratio = growth at 40k / growth at 60k (target 0.9: the
  last 20k events add at most ~10 % more).
* ``alerts_flood_vs_unbounded``: the same flood with caps beyond it (every UUID held, as before the
  caps): ratio = its RSS growth / the capped growth (target 2.0).
* ``alerts_flood_peak_under_bound``: the peak RSS of the default caps' run (60k devices and open
  alerts are under the defaults, so this is what they let the flood hold) against ``PEAK_BOUND_MB``,
  the documented bound: the interpreter and about 5 KB per open alert and its device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import figure, ratio_line, status_mb

FLOOD = 60_000
HOSTS = 5_000
BATCH = 500
TICK_EVERY = 5_000
CAP = 10_000  # --max-devices; twice this held while every device alerts
PEAK_BOUND_MB = 600.0


class _CountingSink:
    """Published records counted, not kept (the harness must not be what grows)."""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, record: dict) -> None:
        self.sent += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        return None


def child(max_devices: int, max_open_alerts: int) -> None:
    import logging

    from gpupipe_consumers.alerts.admission import DeviceAdmission
    from gpupipe_consumers.alerts.engine.facade import EngineConfig
    from gpupipe_consumers.alerts.handler import AlertsHandler
    from gpupipe_consumers.plumbing.consume_loop import InRecord

    logging.disable(logging.WARNING)  # one warning a minute: not what is measured
    now = [1_790_000_000_000]
    svc = AlertsHandler(
        sink=_CountingSink(),
        clock=lambda: now[0] / 1000,
        engine_config=EngineConfig(max_open_alerts=max_open_alerts),
        admission=DeviceAdmission(max_devices=max_devices),
    )
    base = status_mb()
    marks: dict[str, float] = {}
    for start in range(0, FLOOD, BATCH):
        batch = [
            InRecord(
                "gpu.xid.v1",
                0,
                i,
                None,
                "XidEvent",
                {
                    "event_id": f"flood-{i}",
                    "timestamp_ms": now[0],
                    "hostname": f"flood-host-{i % HOSTS:04d}",
                    "kind": "xid",
                    "xid": 13,
                    "pci_bus_id": None,
                    "gpu_index": i % 8,
                    "uuid": f"GPU-flood-{i:08d}-0000-4000-8000-000000000000",
                    "model_name": "NVIDIA H200",
                    "driver_version": "570.124.06",
                    "message": "Graphics Exception",
                    "source": "kmsg",
                    "allocations": [],
                },
                now[0],
            )
            for i in range(start, start + BATCH)
        ]
        svc.handle(batch)
        done = start + BATCH
        now[0] += BATCH // 4  # about 4k records/s, as the adversarial producer
        if done % TICK_EVERY == 0:
            svc.tick()
        if done % 20_000 == 0:
            marks[str(done)] = status_mb() - base
    counts = svc.engine.counts
    print(
        json.dumps(
            {
                "base": base,
                "growth": marks,
                "peak": status_mb("VmHWM"),
                "devices": svc.admission.devices(),
                "open": len(svc.engine.open_alerts()),
                "evicted": svc.admission.counts["evicted_alerting_node"],
                "refused": counts["capped_alert"],
            }
        )
    )


def run_child(max_devices: int, max_open_alerts: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(max_devices), str(max_open_alerts)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from gpupipe.common.argtypes import field_default, keyword_default
    from gpupipe_consumers.alerts.admission import DeviceAdmission
    from gpupipe_consumers.alerts.engine.facade import EngineConfig

    defaults = (
        keyword_default(DeviceAdmission, "max_devices"),
        field_default(EngineConfig, "max_open_alerts"),
    )
    capped = run_child(CAP, 2 * CAP)
    default = run_child(*defaults)
    unbounded = run_child(FLOOD * 10, FLOOD * 10)
    g, u = capped["growth"], unbounded["growth"]
    for name, res in (("capped", capped), ("default_caps", default), ("unbounded", unbounded)):
        figure(f"{name}_devices", res["devices"])
        figure(f"{name}_open_alerts", res["open"])
        figure(f"{name}_refused", res["refused"])
        figure(f"{name}_evicted_alerting_nodes", res["evicted"])
        for k, v in res["growth"].items():
            figure(f"{name}_rss_growth_at_{k}", v, "MB")
        figure(f"{name}_peak_rss", res["peak"], "MB")
    bounded = g["40000"] / max(g["60000"], 1e-9)
    ratio_line("alerts_flood_bounded", bounded, 0.9)
    ratio_line("alerts_flood_vs_unbounded", u["60000"] / max(g["60000"], 1e-9), 2.0)
    ratio_line("alerts_flood_peak_under_bound", PEAK_BOUND_MB / default["peak"], 1.0)
    ok = capped["devices"] <= 2 * CAP and bounded >= 0.9 and default["peak"] <= PEAK_BOUND_MB
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
