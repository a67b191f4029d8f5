"""Blackwell / GB200 NVL72 telemetry on the project's fake NVML.

The fake follows what NVIDIA's mock libnvidia-ml showed for its GB200, B200 and H100 profiles
(checked by hand with nvidia-ml-py 13.615.71; see producer/nvml/fabric.py): 18 NVLink links all up
and error counters 0 on GB200/H100, no links on B200, fabric completed / healthy / mask 426 on
GB200, C2C and module scope NotSupported, platform info NotSupported (GB200) or missing (H100), and
only XID events (0x8) offered. The fake's defaults are the H100/B200-like "no fabric"; the tests
switch on what a GB200 reports (the mock's fabric values, plus C2C, module and placement).
"""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from tests.agent_harness import node_for_fixtures, running_agent, wait_for
from tests.fake_nvml import FakeNvml
from tests.unit.producer.agent.test_node_agent import config, memory_publisher
from tests.unit.producer.nvml.test_source import by_gpu, make, tick

CLUSTER = bytes.fromhex("6b1f0c3e52d47b19e6a03c5d9e7f20b1")


def gb200_node() -> FakeNvml:
    fake = FakeNvml.node("H100", 2)
    for g in fake.gpus:
        g.fabric = {
            "state": 3,
            "status": 0,
            "cliqueId": 7,
            "healthMask": 426,
            "healthSummary": 1,
            "clusterUuid": CLUSTER,
        }
        g.platform = {
            "chassisSerialNumber": b"1821022012345",
            "slotNumber": 3,
            "trayIndex": 5 + g.index,
            "hostId": 1,
            "moduleId": 2 + g.index,
        }
        g.nvlink_links = 18
        g.c2c_links = 2
        g.module_power_mw = 1_450_000
        g.module_energy_mj = 987_654_321
    return fake


def test_fabric_links_c2c_module_power_and_placement() -> None:
    fake = gb200_node()
    g1 = fake.gpus[1]
    g1.fabric = {**g1.fabric, "state": 2, "healthSummary": 3}  # registration still in progress
    g1.nvlink_down = {4}
    g1.nvlink_symbol_errors = {4: 12, 5: 3}
    g1.nvlink_recovery_failed = {4: 1}
    g1.c2c_down = {1}
    _, src, clock, _ = make(fake)
    src.poll()
    s = by_gpu(tick(src, clock))
    a, b = s[0], s[1]
    assert (a["fabric_state"], a["fabric_health"], a["fabric_health_mask"], a["fabric_clique_id"]) == (
        "completed",
        "healthy",
        426,
        7,
    )
    assert a["fabric_cluster_uuid"] == CLUSTER.hex()
    assert (b["fabric_state"], b["fabric_health"]) == ("in_progress", "limited_capacity")
    assert (a["nvlink_links"], a["nvlink_links_up"], b["nvlink_links_up"]) == (18, 18, 17)
    assert (
        b["nvlink_symbol_errors_total"],
        b["nvlink_recovery_failed_total"],
        b["nvlink_rcv_errors_total"],
    ) == (15, 1, 0)
    assert (a["c2c_links"], a["c2c_links_up"], b["c2c_links_up"]) == (2, 2, 1)
    assert a["module_power_w"] == pytest.approx(1450.0) and a["module_energy_mj"] == 987_654_321
    assert a["power_w"] == pytest.approx(512.345), "GPU scope stays the GPU's own"
    assert (
        a["platform_chassis_serial"],
        a["platform_slot"],
        b["platform_tray"],
        b["platform_module_id"],
    ) == (
        "1821022012345",
        3,
        6,
        3,
    )
    assert fake.count("nvmlDeviceGetPlatformInfo", gpu=0) == 1, "placement is read once"
    src.shutdown()


def test_what_the_mock_profiles_show_stays_null_and_quiet() -> None:
    # Defaults = the mock: NVLink links up, no fabric (or refused), no C2C, no module, no platform.
    fake = FakeNvml.node("H100", 1)
    _, src, clock, hooks = make(fake)
    src.poll()
    for _ in range(3):
        s = by_gpu(tick(src, clock, 10.0))[0]
    assert (s["nvlink_links"], s["nvlink_links_up"], s["nvlink_symbol_errors_total"]) == (18, 18, 0)
    for f in ("fabric_state", "c2c_links", "module_power_w", "module_energy_mj", "platform_tray"):
        assert s[f] is None, f
    assert hooks.errors == [] and src.error_counts == {}
    assert fake.count("nvmlDeviceGetPlatformInfo") == 1 and fake.count("nvmlDeviceGetGpuFabricInfoV") == 2
    src.shutdown()


def test_recovery_action_and_gpu_unavailable_events_are_published(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path), pub, fake) as ra:
        ra.ticks_after(1)
        fake.gpus[2].inject_recovery_action(pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
        fake.gpus[4].inject_gpu_unavailable(1)
        wait_for(lambda: ra.agent.xids_sent >= 2, 5, "recovery action and GPU unavailable events")
        ra.stop()
    by_kind = {e["kind"]: e for e in mem.records("xid")}
    un = by_kind["gpu_unavailable"]
    assert (un["xid"], un["gpu_index"], un["uuid"], un["source"]) == (None, 4, fake.gpus[4].uuid, "nvml")
    assert un["message"] == "GPU unavailable (event data 1)"
    ev = by_kind["recovery_action"]
    assert (ev["kind"], ev["xid"], ev["gpu_index"], ev["source"]) == ("recovery_action", None, 2, "nvml")
    assert ev["message"] == "GPU recovery action: DRAIN_AND_RESET (4)"
    assert ev["uuid"] == fake.gpus[2].uuid


def test_nvlink_crc_replay_and_recovery_totals_show_a_flapping_link() -> None:
    # Review §4 item 2: Hopper's NVLink CRC / replay / recovery error totals were read on no GPU, so a
    # single flapping link was invisible. Device-wide fields 38/45/52/59 in the fabric group's call.
    fake = FakeNvml.node("H100", 2)
    fake.gpus[1].nvlink_error_totals = {
        pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: 1_734,
        pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: 12,
    }
    fake, src, clock, _ = make(fake)
    src.poll()
    s = by_gpu(tick(src, clock, 10.0))
    fields = ("nvlink_crc_flit_errors_total", "nvlink_crc_data_errors_total")
    fields += ("nvlink_replay_errors_total", "nvlink_recovery_errors_total")
    assert [s[0][f] for f in fields] == [0, 0, 0, 0]
    assert [s[1][f] for f in fields] == [12, 0, 1_734, 0]
    src.shutdown()
    _, src2, clock2, hooks2 = make(FakeNvml.node("L40S", 1))  # no NVLink: null, quietly
    src2.poll()
    s2 = by_gpu(tick(src2, clock2, 10.0))[0]
    assert all(s2[f] is None for f in fields) and hooks2.errors == []
    src2.shutdown()
