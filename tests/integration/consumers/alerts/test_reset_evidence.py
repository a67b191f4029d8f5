"""Kernel-log recovery evidence end to end: real Kafka, the `gpupipe alerts` CLI.

An Xid 79 (RESTART_BM: firing until evidence) and an Xid 95 (RESET_GPU) are published under boot A; a
driver load of the same boot ends the 95 only (a GPU that fell off the bus is not back because the module
loaded again); the next load line, under boot B, is the reboot and ends the 79.

On node-b, NVML's events, as the node agent encodes them: GPU unavailable (a
critical reset alert; a driver load is no evidence the GPU came back, the reboot is) and a recovery action
DRAIN_AND_RESET (ended by NVML's recovery action NONE), never an "XID 0".

The service runs with ``--no-health-signals``: no sample could confirm a GPU after node-wide evidence,
which therefore ends what it mends at once (gpupipe_consumers.alerts.engine.recovery_policy).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpupipe.kafka import topics
from gpupipe_producer.xid.events import XidContext, nvml_notice_event
from tests.integration.consumers.alerts.test_service import (
    AlertsProcess,
    TopicReader,
    _topics,
    produce,
    wait_until,
    xid_event,
)

pytestmark = pytest.mark.integration

LOADED = (
    "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build  "
    "(dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025"
)


def loaded(host: str, ts: int, boot: str) -> dict:
    return xid_event(
        host,
        "",
        None,
        ts,
        kind="driver_loaded",
        message=LOADED,
        driver_version="570.158.01",
        allocations=[],
        boot_id=boot,
        event_id=f"{host}|kmsg||driver_loaded|{ts}|{boot}",
    )


def notice(kind: str, data: int, ts: int, bus: str) -> dict:
    notice = {"type": kind, "data": data, "uuid": f"GPU-{bus}", "pci_bus_id": bus, "gpu_index": 0}
    ev = nvml_notice_event({**notice, "timestamp_ms": ts}, XidContext("node-b", {}, {}))
    return {**ev, "boot_id": "A"}


def test_driver_load_and_reboot_in_the_kernel_log_resolve_alerts(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    t = _topics(kafka, topic_prefix)
    svc = AlertsProcess(
        kafka, topic_prefix, tmp_path, "--no-health-signals", "--update-interval", "1s"
    ).start()
    reader = TopicReader(kafka, t[topics.ALERTS])
    try:
        now = int(time.time() * 1000)
        produce(
            kafka,
            t[topics.XID],
            "XidEvent",
            [
                xid_event(
                    "node-a", "0000:18:00", 79, now, message="GPU has fallen off the bus.", boot_id="A"
                ),
                xid_event(
                    "node-a",
                    "0000:28:00",
                    95,
                    now + 1,
                    message="Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No",
                    boot_id="A",
                ),
                notice("gpu_unavailable", 0, now + 2, "00000000:18:00.0"),
                notice("recovery_action", 4, now + 3, "00000000:28:00.0"),
            ],
        )

        def by_code() -> dict[int, dict]:
            return {r["xid_codes"][0]: r for r in reader.latest().values() if r["signal"] == "xid"}

        def nvml_alerts() -> dict[str, dict]:
            return {r["signal"]: r for r in reader.latest().values() if r["hostname"] == "node-b"}

        def resolved(code: int) -> dict[int, dict] | None:
            latest = by_code()
            return latest if latest.get(code, {}).get("status") == "resolved" else None

        wait_until(
            lambda: {c: r["status"] for c, r in by_code().items()} == {79: "firing", 95: "firing"},
            30,
            "firing",
        )
        got_b = wait_until(lambda: len(nvml_alerts()) == 2 and nvml_alerts(), 30, "node-b's NVML alerts")
        assert {
            k: (r["alertname"], r["severity"], r["action"], r["xid_codes"]) for k, r in got_b.items()
        } == {
            "gpu_unavailable": ("GpuUnavailable", "critical", "RESET_GPU", []),
            "recovery_action": ("GpuRecoveryActionRequired", "critical", "DRAIN_AND_RESET", []),
        }
        produce(
            kafka,
            t[topics.XID],
            "XidEvent",
            [
                loaded("node-a", now + 1000, "A"),
                notice("recovery_action", 0, now + 1001, "00000000:28:00.0"),
                loaded("node-b", now + 1002, "A"),
            ],
        )
        got_b = wait_until(
            lambda: nvml_alerts()["recovery_action"]["status"] == "resolved" and nvml_alerts(),
            30,
            "node-b's recovery action resolved",
        )
        assert got_b["recovery_action"]["resolve_reason"] == "recovered"
        got = wait_until(lambda: resolved(95), 30, "95 resolved")
        assert (
            got[95]["resolve_reason"] == "recovered" and "driver was loaded again" in got[95]["description"]
        )
        assert got[79]["status"] == "firing"
        produce(
            kafka,
            t[topics.XID],
            "XidEvent",
            [loaded("node-a", now + 60_000, "B"), loaded("node-b", now + 60_001, "B")],
        )
        got = wait_until(lambda: resolved(79), 30, "79 resolved")
        assert got[79]["resolve_reason"] == "recovered"
        assert "rebooted (boot id A -> B)" in got[79]["description"]
        assert got[79]["boot_id"] == "A"
        gone = wait_until(
            lambda: nvml_alerts()["gpu_unavailable"]["status"] == "resolved" and nvml_alerts(),
            30,
            "node-b's GPU unavailable resolved by the reboot",
        )["gpu_unavailable"]
        # node-b's driver load (same boot, before the reboot) did not end it: the reboot did
        assert "rebooted (boot id A -> B)" in gone["description"]
        assert "driver was loaded again" not in gone["description"]
        assert svc.stop() == 0, svc.log_text()[-3000:]
    finally:
        reader.close()
        if svc.proc and svc.proc.poll() is None:
            svc.stop()
