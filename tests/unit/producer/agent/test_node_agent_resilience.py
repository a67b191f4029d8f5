"""The node agent under what a real node does to it.

* XIDs logged while the agent was down are reported after it starts, once: the kmsg backlog is
  read and a persisted cursor (boot id + seq) skips what was handled (1.2).
* A GPU whose NVML calls hang does not delay a kernel-log Xid 79 (< 1 s), the other
  GPUs keep reporting, the stalled GPU is counted (1.6).
* /healthz turns unhealthy when NVML polling stalls, and when NVML sees no GPU (1.6, 1.11).
* A kernel log the agent may not open is one log line and a metric, never a crash (1.1c).

Kernel-log input is in the relay format (raw ``/dev/kmsg`` records, what ``cat /dev/kmsg`` writes),
which carries the sequence numbers the cursor needs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from tests.agent_harness import metric, node_for_fixtures, running_agent, wait_for
from tests.fake_nvml import FakeNvml
from tests.unit.producer.agent.test_node_agent import config, memory_publisher

XID79 = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID48 = "NVRM: Xid (PCI:0000:9b:00): 48, pid=1234, name=python3, An uncorrectable double bit error"


def record(seq: int, message: str, ts_usec: int | None = None) -> str:
    """One /dev/kmsg record as the device (and the relay) writes it."""
    return f"3,{seq},{ts_usec if ts_usec is not None else 1_000_000 + seq * 1000},-;{message}\n"


def _kmsg_config(tmp_path: Path, kmsg: Path, boot: Path, **kw: Any) -> Any:
    return config(tmp_path, kmsg_path=str(kmsg), boot_id_path=str(boot), xid_merge_window_s=0.0, **kw)


def test_xids_logged_while_the_agent_was_down_are_reported_once_after_restart(tmp_path: Path) -> None:
    kmsg, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("b0a7-1\n")
    # Logged before the agent ever started (this boot): reported at the first start.
    kmsg.write_text(record(10, "usb 1-1: new device") + record(11, XID48))
    pub, mem = memory_publisher()
    with running_agent(_kmsg_config(tmp_path, kmsg, boot), pub, node_for_fixtures()) as ra:
        wait_for(lambda: ra.agent.xids_sent >= 1, 5, "backlog Xid 48")
        ra.stop()
    # The agent is down (rolling update, crash loop, OOM kill): the GPU falls off the bus.
    with kmsg.open("a") as f:
        f.write(record(12, "eth0: link up") + record(13, XID79))
    pub2, mem2 = memory_publisher()
    with running_agent(_kmsg_config(tmp_path, kmsg, boot), pub2, node_for_fixtures()) as ra2:
        wait_for(lambda: ra2.agent.xids_sent >= 1, 5, "Xid 79 from while the agent was down")
        ra2.ticks_after(3)
        assert metric(ra2.registry, "gpupipe_producer_kmsg_skipped_records_total") >= 2
        ra2.stop()
    first, second = mem.records("xid"), mem2.records("xid")
    assert [e["xid"] for e in first] == [48]
    assert [e["xid"] for e in second] == [79], "nothing lost, nothing repeated"
    # The event time is the record's own (boot time + kernel time), not when the agent read it.
    assert second[0]["timestamp_ms"] < int(time.time() * 1000) - 1000
    # A reboot (another boot id): seq restarts at 0, the new boot's backlog is read from its start.
    boot.write_text("b0a7-2\n")
    kmsg.write_text(record(0, "Linux version ...") + record(1, XID48))
    pub3, mem3 = memory_publisher()
    with running_agent(_kmsg_config(tmp_path, kmsg, boot), pub3, node_for_fixtures()) as ra3:
        wait_for(lambda: ra3.agent.xids_sent >= 1, 5, "the new boot's Xid 48")
        ra3.stop()
    assert [e["xid"] for e in mem3.records("xid")] == [48]


def test_a_hung_gpu_delays_neither_xids_nor_the_other_gpus(tmp_path: Path) -> None:
    kmsg, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("b0a7-1\n")
    kmsg.write_text("")
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    cfg = _kmsg_config(tmp_path, kmsg, boot, nvml_timeout_s=0.5, interval_s=0.2)
    with running_agent(cfg, pub, fake) as ra:
        ra.ticks_after(2)
        fake.gpus[2].hang(60.0)  # every NVML call on GPU 2 now blocks until the hang ends below
        wait_for(lambda: metric(ra.registry, "gpupipe_producer_nvml_stalled_gpus") == 1, 5, "stall seen")
        began = time.monotonic()
        with kmsg.open("a") as f:
            f.write(record(5, XID79))
        wait_for(lambda: ra.agent.xids_sent >= 1, 5, "Xid 79")
        latency = time.monotonic() - began
        cut = int(time.time() * 1000)
        others = {0, 1, 3, 4, 5, 6, 7}

        def published_since_cut() -> set[int]:
            return {s["gpu_index"] for s in mem.records("samples") if s["timestamp_ms"] >= cut}

        # Samples reach the stand-in broker when the main loop next polls for delivery reports:
        # await them, then a few more ticks, all while GPU 2 still hangs.
        wait_for(lambda: published_since_cut() >= others, 10, "the other GPUs' samples")
        ra.ticks_after(3)
        ok, detail = ra.agent.health()
        later = published_since_cut()
        fake.gpus[2].hang(0)
        ra.stop()
    assert latency < 1.0, f"Xid 79 took {latency:.2f}s while GPU 2 hung"
    (x79,) = mem.records("xid")
    assert (x79["xid"], x79["gpu_index"]) == (79, 2)
    assert later == others, "the other GPUs kept reporting; the hung one is left out"
    assert metric(ra.registry, "gpupipe_producer_nvml_errors_total", {"kind": "call_timeout"}) == 1
    assert ok and detail["stalled_gpus"] == 1  # polling goes on: a restart would not help


def test_healthz_is_unhealthy_when_polling_stalls_and_when_nvml_sees_no_gpu(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    pub, _ = memory_publisher()
    cfg = config(tmp_path, nvml_timeout_s=30.0, stall_after_s=0.6)
    with running_agent(cfg, pub, fake) as ra:
        ra.ticks_after(1)
        assert ra.agent.health()[0]
        for g in fake.gpus:
            g.hang(3.0)
        wait_for(lambda: not ra.agent.health()[0], 5, "unhealthy")
        assert "nvml_polling_stalled" in ra.agent.health()[1]["problems"]
        for g in fake.gpus:
            g.hang(0)
        wait_for(lambda: ra.agent.health()[0], 10, "healthy again")
        ra.stop()
    none = FakeNvml([])
    with running_agent(config(tmp_path / "none"), *memory_publisher()[:1], none) as ra0:
        ok, detail = ra0.agent.health()
        ra0.stop()
    assert not ok and detail["problems"] == ["nvml_sees_no_gpu"]
    assert metric(ra0.registry, "gpupipe_producer_gpus", {"state": "ok"}) == 0


def test_an_unreadable_kernel_log_is_one_log_line_and_a_metric(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Here the path is absent (ENOENT); tests/integration/producer/test_privileges.py opens the
    # real /dev/kmsg without CAP_SYSLOG (EPERM) under the manifest's privileges.
    cfg = config(tmp_path, kmsg_path=str(tmp_path / "kmsg-denied"), kmsg_retry_s=0.05)
    pub, _ = memory_publisher()
    with caplog.at_level(logging.ERROR, "gpupipe.agent"), running_agent(cfg, pub, node_for_fixtures()) as ra:
        wait_for(
            lambda: (
                metric(
                    ra.registry,
                    "gpupipe_producer_input_errors_total",
                    {"input": "kmsg", "reason": "ENOENT"},
                )
                >= 5
            ),
            5,
            "retries",
        )
        ra.ticks_after(2)
        assert metric(ra.registry, "gpupipe_producer_source_up", {"input": "kmsg"}) == 0
        ra.stop()
    lines = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_two_identical_xids_in_one_millisecond_are_two_events(tmp_path: Path) -> None:
    # Review §2: event_id = host|source|bus|code|ms collided, and consumers drop duplicates by id.
    kmsg, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("b0a7-1\n")
    kmsg.write_text("")
    pub, mem = memory_publisher()
    with running_agent(_kmsg_config(tmp_path, kmsg, boot), pub, node_for_fixtures()) as ra:
        with kmsg.open("a") as f:
            # The same kernel timestamp: the boot-time offset added to it is fractional, so two stamps
            # even 200 us apart can fall either side of a millisecond boundary.
            f.write(record(30, XID48, ts_usec=5_000_000) + record(31, XID48, ts_usec=5_000_000))
        wait_for(lambda: ra.agent.xids_sent >= 2, 5, "two XIDs")
        ra.stop()
    a, b = mem.records("xid")
    assert a["timestamp_ms"] == b["timestamp_ms"] and a["event_id"] != b["event_id"]
    assert a["event_id"].endswith("|s30") and b["event_id"].endswith("|s31")


def test_a_gpu_lost_before_start_is_reported_once_per_boot(tmp_path: Path) -> None:
    # Review 1.11: every restart emitted a new gpu_lost event (its id embeds the time it was seen).
    boot = tmp_path / "boot_id"
    boot.write_text("b0a7-1\n")

    def run() -> list[dict[str, Any]]:
        fake = node_for_fixtures()
        fake.gpus[3].lost = True  # fell off the bus before the agent started
        pub, mem = memory_publisher()
        with running_agent(config(tmp_path, boot_id_path=str(boot)), pub, fake) as ra:
            ra.ticks_after(3)
            ra.stop()
        return mem.records("xid")

    first, second = run(), run()
    assert [(e["kind"], e["gpu_index"]) for e in first] == [("gpu_lost", 3)]
    assert second == [], "the restart does not report the same loss again"
    boot.write_text("b0a7-2\n")  # after a reboot it is a new loss
    assert [e["kind"] for e in run()] == ["gpu_lost"]


def test_a_full_disk_under_the_spool_keeps_the_agent_and_the_xid(tmp_path: Path) -> None:
    # Review 1.3 on the whole agent: the first XID after the disk filled killed it (OSError 28 out of
    # the main loop), and that XID was in neither the spool nor Kafka.
    import os

    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path), pub, fake) as ra:
        ra.ticks_after(1)
        assert ra.agent.sender is not None
        spool = ra.agent.sender.spool
        full = os.open("/dev/full", os.O_WRONLY)  # the spool file's descriptor now answers ENOSPC
        os.dup2(full, spool._fd)
        os.close(full)
        fake.gpus[1].inject_xid(48)
        wait_for(lambda: any(e["xid"] == 48 for e in mem.records("xid")), 5, "Xid 48 published")
        ticks = ra.agent.ticks
        ra.ticks_after(2)
        assert ra.thread.is_alive() and ra.agent.ticks >= ticks + 2
        assert metric(ra.registry, "gpupipe_producer_xid_spool_write_errors_total") >= 1
        assert metric(ra.registry, "gpupipe_producer_xid_spool_on_disk") == 0
        ra.stop()


def test_an_xid_storm_costs_one_fsync_per_batch_and_a_log_line_per_gpu_and_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Review §2 xid_merge.py: every event of a storm got its own fsync (about 0.2 ms) and WARNING.
    # The main loop is driven by hand here (started, not run), so the batch is exactly the queue.
    import os

    from gpupipe_producer.agent.node_agent import NodeAgent
    from gpupipe_producer.self_metrics import ProducerMetrics
    from gpupipe_producer.xid.kmsg_parse import parse_line
    from gpupipe_schemas.codec import AvroCodec

    xid13 = parse_line(
        "[ 10.0] NVRM: Xid (PCI:0000:9b:00): 13, pid=7, name=python, Graphics SM Warp Exception"
    )
    assert xid13 is not None
    pub, mem = memory_publisher()
    agent = NodeAgent(
        config(tmp_path, nvml_events=False), pub, ProducerMetrics(), AvroCodec(), "s", "xid",
        nvml=node_for_fixtures(),
    )  # fmt: skip
    agent._start()
    from gpupipe_producer.xid.spool_format import SPOOL_FILE

    spool_file = str(tmp_path / "spool" / SPOOL_FILE)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    try:
        monkeypatch.setattr(os, "fsync", fsync)
        for i in range(2500):
            agent.inbox.put(("kmsg", time.monotonic(), 1_767_225_600_000 + i, xid13, None))
        with caplog.at_level(logging.WARNING, "gpupipe.agent"):
            agent.xids.drain(0.0)
        assert agent.xids_sent + len(agent.merger) == 2500  # the merger may hold the newest one
        assert synced.count(spool_file) == 3  # batches of at most 1000
        lines = [r for r in caplog.records if r.getMessage().startswith("GPU error event")]
        assert len(lines) == 1, "one line for one GPU and code within 10 s"
    finally:
        monkeypatch.undo()
        agent._shutdown()
    assert len([x for x in mem.records("xid") if x["xid"] == 13]) == 2500


def test_two_identical_nvml_xids_are_two_events(tmp_path: Path) -> None:
    # Review §2 records.py:80-81 for NVML alone (no kernel-log record number to tell them apart): two
    # Xid 48 of one GPU in the same millisecond shared an event_id, and consumers drop duplicates.
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path, nvml_event_timeout_ms=50), pub, fake) as ra:
        ra.ticks_after(1)
        fake.gpus[1].inject_xid(48)
        fake.gpus[1].inject_xid(48)
        fake.gpus[3].inject_recovery_action(1)
        fake.gpus[3].inject_recovery_action(1)
        wait_for(lambda: ra.agent.xids_sent >= 4, 5, "four NVML events")
        ra.stop()
    ids = [e["event_id"] for e in mem.records("xid")]
    assert len(set(ids)) == 4 and all("|n" in i for i in ids), ids
