"""NvmlSource and its collectors, run for real against the fake NVML module (tests/fake_nvml.py).

Time is a FakeClock shared by the source and the fake: nothing sleeps, ticks are explicit.
Every sample any test produces goes through the project's Avro encoder.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpupipe.common.errors import ConfigError, GpupipeError
from gpupipe.domain import pci
from gpupipe_producer.nvml import (
    GpuRef,
    LostGpu,
    NvmlInitError,
    NvmlSource,
    NvmlSourceError,
    SourceHooks,
    gpu_lost_xid_event,
)
from gpupipe_producer.nvml.records import METRIC_FIELDS, SAMPLE_FIELDS
from gpupipe_schemas.codec import AvroCodec
from tests.fake_nvml import (
    FIXTURES_DIR,
    GIB,
    MIB,
    FakeClock,
    FakeGpu,
    FakeMigSlice,
    FakeNvml,
    FakeProcess,
    load_fixture,
)

CODEC = AvroCodec()
SAMPLE_ENCODER = CODEC.encoder("GpuSample")
XID_ENCODER = CODEC.encoder("XidEvent")
PROFILING_FIELDS = (
    "gr_engine_active_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "tensor_active_ratio",
    "dram_active_ratio",
    "fp64_active_ratio",
    "fp32_active_ratio",
    "fp16_active_ratio",
    "nvlink_tx_bytes_per_s",
    "nvlink_rx_bytes_per_s",
)
# Fields an H100 on bare metal cannot report (Ampere+ has no page retirement) or this
# source does not fill (vGPU licence, XIDs come from the event watcher).
H100_NULL_FIELDS = {
    "retired_pages_sbe",
    "retired_pages_dbe",
    "retired_pages_pending",
    "vgpu_license_status",
    "last_xid",
    # Blackwell / GB200 only (an H100 has NVLink, but no fabric, C2C, module scope or placement)
    "fabric_state",
    "fabric_health",
    "fabric_health_mask",
    "fabric_clique_id",
    "fabric_cluster_uuid",
    "c2c_links",
    "c2c_links_up",
    "module_power_w",
    "module_energy_mj",
    "platform_chassis_serial",
    "platform_slot",
    "platform_tray",
    "platform_host_id",
    "platform_module_id",
    # newer drivers (R590/R615) and Blackwell power smoothing: the double's default, as NVIDIA's mock
    "bank_remap_pending",
    "bank_remaps_active",
    "memory_unrepairable",
    "power_smoothing_enabled",
    "power_smoothing_profile",
    "power_smoothing_tmp_ceiling_w",
    "power_smoothing_tmp_floor_w",
    "power_smoothing_lifetime_remaining_ratio",
}


class RecordingHooks(SourceHooks):
    def __init__(self) -> None:
        self.durations: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self.garbage_fields: list[str] = []
        self.failures: list[tuple[str, BaseException]] = []
        self.lost: list[LostGpu] = []
        self.recovered: list[GpuRef] = []

    def collect_duration(self, group: str, seconds: float) -> None:
        self.durations.append((group, seconds))

    def nvml_error(self, kind: str) -> None:
        self.errors.append(kind)

    def garbage(self, field: str) -> None:
        self.garbage_fields.append(field)

    def collector_failure(self, group: str, exc: BaseException) -> None:
        self.failures.append((group, exc))

    def gpu_lost(self, lost: LostGpu) -> None:
        self.lost.append(lost)

    def gpu_recovered(self, gpu: GpuRef) -> None:
        self.recovered.append(gpu)


def make(fake: FakeNvml | None = None, clock: FakeClock | None = None, **kw: Any):
    clock = clock or FakeClock()
    if fake is None:
        fake = FakeNvml.node("H100", 8, clock=clock)
    else:
        fake.clock = clock
    hooks = kw.pop("hooks", None) or RecordingHooks()
    src = NvmlSource(fake, "node-a", kw.pop("intervals", None), clock, clock.wall, hooks=hooks, **kw)
    src.start()
    return fake, src, clock, hooks


def encode_all(samples: list[dict[str, Any]]) -> None:
    for s in samples:
        assert set(s) == set(SAMPLE_FIELDS), set(SAMPLE_FIELDS) ^ set(s)
        SAMPLE_ENCODER.encode(s)


def by_gpu(samples: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {s["gpu_index"]: s for s in samples if s["mig"] is None}


def tick(src: NvmlSource, clock: FakeClock, seconds: float = 1.0) -> list[dict[str, Any]]:
    clock.advance(seconds)
    out = src.poll()
    encode_all(out)
    return out


# -- the full node --------------------------------------------------------------------------------


def test_eight_h100_full_field_set_with_unit_conversions():
    fake, src, clock, _hooks = make()
    first = src.poll()
    encode_all(first)
    samples = tick(src, clock)  # the second tick has GPM rates (two samples 1 s apart)
    assert [s["gpu_index"] for s in samples] == list(range(8))
    for s in samples:
        g = fake.gpus[s["gpu_index"]]
        assert s["hostname"] == "node-a"
        assert s["uuid"] == g.uuid and s["uuid"].startswith("GPU-")
        assert s["pci_bus_id"] == g.pci_bus_id and isinstance(s["pci_bus_id"], str)
        assert s["model_name"] == "NVIDIA H100 80GB HBM3"
        assert s["driver_version"] == "570.124.06"
        assert s["numa_node"] == s["gpu_index"] // 4
        assert s["mig"] is None and s["mig_enabled"] is False and s["gpu_lost"] is False
        assert s["interval_ms"] == 1000
        assert s["timestamp_ms"] == int(clock.wall() * 1000)
        assert s["allocations"] == []
        # mW -> W, mJ, bytes, % -> ratio, MHz, C, ns
        assert s["power_w"] == pytest.approx(g.power_mw / 1000)
        assert s["power_limit_w"] == 700.0
        assert s["total_energy_mj"] == g.energy_mj
        assert s["gpu_util_ratio"] == pytest.approx(g.util_gpu / 100)
        assert s["mem_copy_util_ratio"] == pytest.approx(g.util_memory / 100)
        assert s["dec_util_ratio"] == pytest.approx(g.dec_util / 100)
        assert s["fb_total_bytes"] == g.fb_total
        assert s["fb_used_bytes"] == g.fb_used
        assert s["fb_reserved_bytes"] == g.fb_reserved
        assert s["fb_free_bytes"] == g.fb_total - g.fb_used - g.fb_reserved
        assert s["gpu_temp_c"] == 61.0 and s["memory_temp_c"] == 70.0
        assert s["sm_clock_mhz"] == 1980 and s["mem_clock_mhz"] == 2619
        assert s["clock_event_reasons"] == 0x4
        assert s["power_violation_ns"] == g.power_violation_ns
        assert s["thermal_violation_ns"] == 0
        # GPM: % -> ratio, MiB/s -> bytes/s; PCIe comes from GPM on Hopper
        assert s["gr_engine_active_ratio"] == pytest.approx(0.925)
        assert s["sm_active_ratio"] == pytest.approx(0.80)
        assert s["sm_occupancy_ratio"] == pytest.approx(0.35)
        assert s["tensor_active_ratio"] == pytest.approx(0.45)
        assert s["dram_active_ratio"] == pytest.approx(0.55)
        assert s["fp64_active_ratio"] == pytest.approx(0.005)
        assert s["fp32_active_ratio"] == pytest.approx(0.20)
        assert s["fp16_active_ratio"] == pytest.approx(0.05)
        assert s["pcie_tx_bytes_per_s"] == pytest.approx(100.0 * MIB)
        assert s["pcie_rx_bytes_per_s"] == pytest.approx(200.0 * MIB)
        assert s["nvlink_tx_bytes_per_s"] == pytest.approx(1500.0 * MIB)
        assert s["nvlink_rx_bytes_per_s"] == pytest.approx(1000.0 * MIB)
        assert s["nvlink_bandwidth_total_kib"] == g.nvlink_tx_kib + g.nvlink_rx_kib
        # slow group
        assert s["ecc_sbe_volatile_total"] == 5 and s["ecc_dbe_aggregate_total"] == 1
        assert s["remapped_rows_correctable"] == 3 and s["remapped_rows_uncorrectable"] == 1
        assert s["row_remap_pending"] is False and s["row_remap_failure"] is False
        assert s["pcie_replay_count"] == 2
        assert s["gpu_recovery_action"] == 0
        missing = {f for f in METRIC_FIELDS if s[f] is None}
        assert missing == H100_NULL_FIELDS
    assert fake.unimplemented_calls == set()
    assert src.error_counts == {} and src.garbage_counts == {} and src.collector_failures == {}
    assert fake.gpm_too_close == 0
    # The first tick had no GPM rates yet (one sample only), everything else was there.
    assert all(first[0][f] is None for f in PROFILING_FIELDS)
    assert first[0]["power_w"] is not None


def test_h200_node_identity_and_memory():
    _fake, src, _clock, _ = make(FakeNvml.node("H200", 8))
    s = by_gpu(src.poll())
    assert s[7]["model_name"] == "NVIDIA H200"
    assert s[7]["fb_total_bytes"] == 143771 * MIB
    encode_all(list(s.values()))


def test_pcie_from_the_legacy_call_in_kb_per_s_without_gpm():
    fake, src, _clock, _ = make(collectors=("fast", "slow"))
    s = by_gpu(src.poll())[0]
    assert s["pcie_tx_bytes_per_s"] == 123_456 * 1024.0
    assert s["pcie_rx_bytes_per_s"] == 654_321 * 1024.0
    assert all(s[f] is None for f in PROFILING_FIELDS)
    assert fake.count("nvmlGpmSampleGet") == 0


def test_gpm_measures_pcie_so_the_20ms_legacy_call_is_not_made_on_hopper():
    fake, src, clock, _ = make()
    src.poll()
    tick(src, clock)
    assert fake.count("nvmlDeviceGetPcieThroughput") == 0


# -- unsupported fields ---------------------------------------------------------------------------


def test_not_supported_learned_once_and_null():
    gpus = [FakeGpu.h100(i) for i in range(2)]
    gpus[0].unsupported |= {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetEncoderUtilization"}
    gpus[0].unsupported_fields |= {pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_POWER_AVERAGE}
    fake, src, clock, _ = make(FakeNvml(gpus))
    for _ in range(4):
        s = by_gpu(tick(src, clock))
    assert s[0]["power_w"] is None and s[0]["enc_util_ratio"] is None and s[0]["memory_temp_c"] is None
    assert s[1]["power_w"] is not None and s[1]["memory_temp_c"] == 70.0
    # Power comes from the batched field; the classic call is tried once the field is refused.
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=0) == 1
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=1) == 0
    # 4 at GPU scope, plus the one module-scope probe (GB200 only: learned unsupported here).
    assert fake.field_requests[(1, pynvml.NVML_FI_DEV_POWER_AVERAGE)] == 5
    assert fake.count("nvmlDeviceGetEncoderUtilization", gpu=0) == 1
    assert fake.field_requests[(0, pynvml.NVML_FI_DEV_MEMORY_TEMP)] == 1
    assert fake.field_requests[(1, pynvml.NVML_FI_DEV_MEMORY_TEMP)] == 4
    assert {"power", "enc", "fi_memory_temp"} <= src.unsupported(0)
    assert src.error_counts == {}  # NotSupported is "no data", not an error


def test_slow_group_unsupported_learned_once_across_slow_polls():
    fake, src, clock, _ = make(FakeNvml.node("H100", 1))
    src.poll()
    tick(src, clock, 30.0)
    tick(src, clock, 30.0)
    assert fake.count("nvmlDeviceGetTotalEccErrors", gpu=0) == 3 * 4
    assert fake.count("nvmlDeviceGetRetiredPages", gpu=0) == 2  # sbe + dbe, once each
    assert fake.count("nvmlDeviceGetRetiredPagesPendingStatus", gpu=0) == 1


def test_nvlink_probe_invalid_argument_is_learned():
    fake = FakeNvml.node("H100", 1)
    real_get = fake.nvmlDeviceGetFieldValues

    def links_rejected(handle, field_ids):
        values = real_get(handle, field_ids)
        for fv in values:
            if fv.fieldId in (138, 139):
                fv.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT  # GB200-style link rejection
        return values

    fake.nvmlDeviceGetFieldValues = links_rejected
    fake, src, clock, _ = make(fake)
    src.poll()
    s = by_gpu(tick(src, clock))[0]
    assert s["nvlink_bandwidth_total_kib"] is None and s["memory_temp_c"] == 70.0
    assert fake.field_requests[(0, 138)] == 1 and fake.field_requests[(0, 82)] == 2
    assert src.error_counts == {}


def test_l40s_without_mig_gpm_or_nvlink():
    fake, src, clock, _ = make(FakeNvml.node("L40S", 2))
    src.poll()
    s = by_gpu(tick(src, clock))[0]
    assert s["mig_enabled"] is False
    assert s["nvlink_bandwidth_total_kib"] is None
    assert all(s[f] is None for f in PROFILING_FIELDS)
    assert s["pcie_tx_bytes_per_s"] == 123_456 * 1024.0
    assert fake.count("nvmlDeviceGetMigMode", gpu=0) == 1  # NotSupported: learned at start
    # Review §3: memory temperature (FI 82) is HBM-only; GDDR boards answer NotSupported (null,
    # learned quietly), though NVIDIA's mock returns a value for its L40S and T4 profiles.
    assert s["memory_temp_c"] is None and s["gpu_temp_c"] is not None
    assert "fi_memory_temp" in src.unsupported(0)


def test_temperature_falls_back_to_the_deprecated_call_when_v_is_missing():
    gpus = [FakeGpu.h100(0, unsupported={"nvmlDeviceGetTemperatureV"})]
    fake, src, clock, _ = make(FakeNvml(gpus))
    src.poll()
    s = by_gpu(tick(src, clock))[0]
    assert s["gpu_temp_c"] == 61.0
    assert fake.count("nvmlDeviceGetTemperatureV", gpu=0) == 1
    assert fake.count("nvmlDeviceGetTemperature", gpu=0) == 2


def test_memory_info_v1_fallback_without_reserved():
    gpus = [FakeGpu.h100(0, unsupported={"nvmlDeviceGetMemoryInfo_v2"})]
    fake, src, _clock, _ = make(FakeNvml(gpus))
    s = by_gpu(src.poll())[0]
    g = fake.gpus[0]
    assert s["fb_reserved_bytes"] is None
    assert s["fb_used_bytes"] == g.fb_used + g.fb_reserved  # v1 counts reserved as used
    assert s["fb_total_bytes"] == g.fb_total
    encode_all([s])


# -- lost GPU -------------------------------------------------------------------------------------


def test_gpu_lost_mid_run_others_continue_and_loss_reported_once():
    fake, src, clock, hooks = make()
    src.poll()
    fake.gpus[3].lose()
    samples = tick(src, clock)
    assert len(samples) == 8
    s = by_gpu(samples)
    lost = s[3]
    assert lost["gpu_lost"] is True
    assert all(lost[f] is None for f in METRIC_FIELDS)
    assert lost["processes"] == [] and lost["allocations"] == []
    assert lost["uuid"] == fake.gpus[3].uuid and lost["pci_bus_id"] == fake.gpus[3].pci_bus_id
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert s[i]["gpu_lost"] is False and s[i]["power_w"] is not None
    assert len(hooks.lost) == 1
    info = hooks.lost[0]
    assert info.gpu.gpu_index == 3 and info.gpu.uuid == fake.gpus[3].uuid
    assert "GPU is lost" in info.message
    assert [g.gpu_index for g in src.lost_gpus] == [3]
    assert src.error_counts["NVMLError_GpuIsLost"] == 1
    event = gpu_lost_xid_event(info, "node-a")
    XID_ENCODER.encode(event)
    assert event["kind"] == "gpu_lost" and event["xid"] is None and event["source"] == "nvml"
    # Later polls: still one lost record per poll, no further callback, NVML left alone.
    calls_before = sum(n for (_, gpu), n in fake.calls.items() if gpu == 3)
    for _ in range(5):
        assert by_gpu(tick(src, clock))[3]["gpu_lost"] is True
    assert len(hooks.lost) == 1
    assert sum(n for (_, gpu), n in fake.calls.items() if gpu == 3) == calls_before


def test_lost_gpu_probed_and_back_after_reset():
    fake, src, clock, hooks = make(intervals={"lost_retry": 10})
    src.poll()
    fake.gpus[5].lose()
    tick(src, clock)
    tick(src, clock, 10.0)  # probe: still lost
    assert by_gpu(src.poll())[5]["gpu_lost"] is True
    fake.gpus[5].recover()
    assert by_gpu(tick(src, clock, 5.0))[5]["gpu_lost"] is True  # not yet time to probe
    back = by_gpu(tick(src, clock, 5.0))[5]
    assert back["gpu_lost"] is False and back["power_w"] is not None and back["ecc_sbe_volatile_total"] == 5
    assert [g.gpu_index for g in hooks.recovered] == [5]
    assert src.lost_gpus == []
    fake.gpus[5].lose()  # a second loss is a second event
    tick(src, clock)
    assert len(hooks.lost) == 2


def test_gpu_lost_before_start_is_reported_with_what_is_known():
    fake = FakeNvml.node("H100", 2)
    fake.gpus[1].lost = True
    fake, src, _clock, hooks = make(fake)
    s = by_gpu(src.poll())
    assert s[1]["gpu_lost"] is True and s[0]["gpu_lost"] is False
    assert s[1]["uuid"] == "" and s[1]["gpu_index"] == 1
    assert len(hooks.lost) == 1
    encode_all(list(s.values()))


# -- MIG ------------------------------------------------------------------------------------------


def mig_node() -> FakeNvml:
    gpus = [FakeGpu.h100(i) for i in range(2)]
    gpus[1].enable_mig(
        [
            FakeMigSlice(
                "3g.40gb",
                gpu_instance_id=2,
                fb_total=40 * GIB,
                fb_used=10 * GIB,
                processes=[FakeProcess(700, "vllm", used_memory=9 * GIB, sm_util=None, mem_util=None)],
                index=0,
            ),
            FakeMigSlice("1c.4g.40gb", gpu_instance_id=1, compute_instance_id=1, index=3),  # index 1, 2 empty
        ]
    )
    return FakeNvml(gpus)


def test_mig_parent_and_slices_with_identity():
    fake, src, clock, _ = make(mig_node())
    src.poll()
    samples = tick(src, clock)
    assert len(samples) == 2 + 2
    gpu1 = [s for s in samples if s["gpu_index"] == 1]
    parent = next(s for s in gpu1 if s["mig"] is None)
    slices = sorted((s for s in gpu1 if s["mig"] is not None), key=lambda s: s["mig"]["gpu_instance_id"])
    assert parent["mig_enabled"] is True
    assert parent["gpu_util_ratio"] is None  # NVML: not supported on MIG-enabled GPUs
    assert parent["power_w"] is not None and parent["total_energy_mj"] is not None
    assert parent["processes"] == []  # the slices carry them
    g = fake.gpus[1]
    s3, s4 = slices[1], slices[0]
    assert s3["mig"] == {
        "mig_uuid": g.mig_slices[0].uuid,
        "gpu_instance_id": 2,
        "compute_instance_id": 0,
        "profile": "3g.40gb",
        "slice_fraction": pytest.approx(3 / 7),
    }
    assert s4["mig"]["profile"] == "4g.40gb" and s4["mig"]["compute_instance_id"] == 1
    assert s4["mig"]["slice_fraction"] == pytest.approx(1 / 7)
    for s in slices:
        assert s["uuid"] == g.uuid and s["pci_bus_id"] == g.pci_bus_id and s["gpu_index"] == 1
        assert s["mig_enabled"] is None
        assert s["mig"]["mig_uuid"].startswith("MIG-")
        assert s["power_w"] is None and s["ecc_sbe_volatile_total"] is None  # whole-GPU values
        assert s["gr_engine_active_ratio"] == pytest.approx(0.925)  # GPM per GPU instance
    assert s3["fb_total_bytes"] == 40 * GIB and s3["fb_used_bytes"] == 10 * GIB
    assert s3["processes"] == [
        {
            "pid": 700,
            "process_name": "vllm",
            "used_memory_bytes": 9 * GIB,
            "sm_util_ratio": None,
            "mem_util_ratio": None,
            "namespace": None,
            "pod": None,
            "container": None,
        }
    ]
    assert fake.count("nvmlGpmMigSampleGet", gpu=1) == 4  # 2 slices x 2 ticks
    assert fake.count("nvmlDeviceGetProcessUtilization", gpu=1) == 0
    assert fake.unimplemented_calls == set()
    assert src.mig_uuid_for(g.uuid, 2, 0) == g.mig_slices[0].uuid
    assert src.mig_uuid_for(g.uuid, 9, None) is None


def test_mig_reconfiguration_is_picked_up_at_the_mig_interval():
    fake, src, clock, _ = make(mig_node(), intervals={"mig": 10})
    src.poll()
    tick(src, clock)
    old_uuids = {s.uuid for s in fake.gpus[1].mig_slices}
    fake.gpus[1].enable_mig(["7g.80gb"])
    assert len(tick(src, clock, 1.0)) == 4  # not re-enumerated yet: old slices, stale handles
    samples = tick(src, clock, 9.0)
    slices = [s for s in samples if s["mig"] is not None]
    assert [s["mig"]["profile"] for s in slices] == ["7g.80gb"]
    assert slices[0]["mig"]["slice_fraction"] == 1.0
    assert slices[0]["mig"]["mig_uuid"] not in old_uuids
    src.shutdown()
    assert fake.allocated_gpm_samples == 0


def test_mig_mode_turned_off_relearns_support():
    fake, src, clock, _ = make(mig_node(), intervals={"mig": 5})
    src.poll()
    assert by_gpu(tick(src, clock))[1]["gpu_util_ratio"] is None
    assert "util" in src.unsupported(1)
    fake.gpus[1].disable_mig()
    samples = tick(src, clock, 5.0)
    s = by_gpu(samples)[1]
    assert s["mig_enabled"] is False and s["gpu_util_ratio"] == pytest.approx(0.87)
    assert s["ecc_sbe_volatile_total"] == 5  # slow group re-read at once, not 30 s later
    assert s["remapped_rows_correctable"] == 3  # NotSupported in MIG mode, answered now
    assert [x for x in samples if x["mig"] is not None] == []


# -- GPM ------------------------------------------------------------------------------------------


def test_gpm_off_on_ampere_never_called_again():
    fake, src, clock, _ = make(load_fixture("a100_ampere"))
    for _ in range(5):
        s = by_gpu(tick(src, clock))
    for x in s.values():
        assert all(x[f] is None for f in PROFILING_FIELDS)
        assert x["gpu_util_ratio"] is not None
        assert x["pcie_tx_bytes_per_s"] == 123_456 * 1024.0  # legacy call when GPM cannot
    assert fake.count("nvmlGpmQueryDeviceSupport") == 4  # once per GPU, at start
    assert fake.count("nvmlGpmSampleAlloc") == 0
    assert fake.count("nvmlGpmSampleGet") == 0
    assert fake.count("nvmlGpmMetricsGet") == 0
    assert all("gpm" in src.unsupported(i) for i in range(4))


def test_gpm_keeps_the_previous_sample_instead_of_sleeping():
    fake, src, clock, _ = make(FakeNvml.node("H100", 1))
    assert by_gpu(src.poll())[0]["sm_active_ratio"] is None
    assert by_gpu(tick(src, clock))[0]["sm_active_ratio"] == pytest.approx(0.8)
    fake.set_gpm(0, {pynvml.NVML_GPM_METRIC_SM_UTIL: 10.0})
    assert by_gpu(tick(src, clock))[0]["sm_active_ratio"] == pytest.approx(0.1)
    # A poll 50 ms later takes no new sample: the last rates are repeated.
    gets = fake.count("nvmlGpmSampleGet")
    assert by_gpu(tick(src, clock, 0.05))[0]["sm_active_ratio"] == pytest.approx(0.1)
    assert fake.count("nvmlGpmSampleGet") == gets
    assert fake.gpm_too_close == 0
    assert fake.count("nvmlGpmSampleAlloc") == 2  # two buffers per device, reused
    src.shutdown()
    assert fake.allocated_gpm_samples == 0
    assert fake.init_count == 0


def test_gpm_metric_not_supported_learned_per_metric():
    gpus = [FakeGpu.h100(0, unsupported_gpm_metrics={pynvml.NVML_GPM_METRIC_FP64_UTIL})]
    _fake, src, clock, _ = make(FakeNvml(gpus))
    src.poll()
    tick(src, clock)
    s = by_gpu(tick(src, clock))[0]
    assert s["fp64_active_ratio"] is None and s["fp32_active_ratio"] == pytest.approx(0.2)
    assert "gpm_metric:11" in src.unsupported(0)


# -- processes ------------------------------------------------------------------------------------


def test_processes_with_per_process_utilisation_and_names():
    procs = [
        FakeProcess(4711, "python3", used_memory=60 * GIB, sm_util=90, mem_util=40),
        FakeProcess(4712, "sidecar", used_memory=None, sm_util=None, mem_util=None),
    ]
    fake, src, clock, _ = make(FakeNvml([FakeGpu.h100(0, processes=procs)]))
    first = by_gpu(src.poll())[0]
    # The first utilisation call (lastSeen 0: the driver's whole buffer) only primes the window.
    assert [p["sm_util_ratio"] for p in first["processes"]] == [None, None]
    s = by_gpu(tick(src, clock, 5.0))[0]
    assert s["processes"] == [
        {
            "pid": 4711,
            "process_name": "python3",
            "used_memory_bytes": 60 * GIB,
            "sm_util_ratio": 0.9,
            "mem_util_ratio": 0.4,
            "namespace": None,
            "pod": None,
            "container": None,
        },
        {
            "pid": 4712,
            "process_name": "sidecar",
            "used_memory_bytes": None,  # NVML could not tell
            "sm_util_ratio": None,
            "mem_util_ratio": None,
            "namespace": None,
            "pod": None,
            "container": None,
        },
    ]
    encode_all([s])
    # processes run every 5 s; in between, the list is repeated (copies, not shared dicts)
    t1 = by_gpu(tick(src, clock))[0]
    assert t1["processes"] == s["processes"] and t1["processes"][0] is not s["processes"][0]
    fake.gpus[0].processes.pop(0)
    later = by_gpu(tick(src, clock, 5.0))[0]
    assert [p["pid"] for p in later["processes"]] == [4712]
    assert fake.count("nvmlSystemGetProcessName") == 2  # names cached per pid
    assert fake.count("nvmlDeviceGetComputeRunningProcesses", gpu=0) == 3


def test_no_process_utilisation_samples_is_not_unsupported():
    procs = [FakeProcess(1, "idle", sm_util=None, mem_util=None)]
    fake, src, clock, _ = make(FakeNvml([FakeGpu.h100(0, processes=procs)]))
    src.poll()
    tick(src, clock, 5.0)
    assert fake.count("nvmlDeviceGetProcessUtilization", gpu=0) == 2  # NotFound: asked again
    assert "proc_util" not in src.unsupported(0)


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVML init failed: Driver Not Loaded"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML init failed: NVML Shared Library Not Found"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "NVML init failed: Insufficient Permissions"),
    ],
)
def test_init_failure_is_a_clear_gpupipe_error(code, text):
    src = NvmlSource(FakeNvml.node(init_error=code), "node-a")
    with pytest.raises(NvmlInitError) as info:
        src.start()
    assert str(info.value) == text
    assert isinstance(info.value, GpupipeError)
    assert isinstance(info.value.__cause__, pynvml.NVMLError)


def test_poll_before_start_and_after_shutdown():
    fake = FakeNvml.node("H100", 1)
    src = NvmlSource(fake, "node-a")
    with pytest.raises(NvmlSourceError):
        src.poll()
    src.start()
    src.poll()
    src.shutdown()
    src.shutdown()  # idempotent
    assert fake.init_count == 0
    with pytest.raises(NvmlSourceError):
        src.poll()


def test_transient_nvml_error_counted_and_retried_next_time():
    fake, src, clock, hooks = make(FakeNvml.node("H100", 2))
    fake.gpus[0].fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_UNKNOWN)
    s = by_gpu(src.poll())
    assert s[0]["gpu_util_ratio"] is None and s[1]["gpu_util_ratio"] is not None
    assert src.error_counts["NVMLError_Unknown"] == 1
    assert hooks.errors == ["NVMLError_Unknown"]
    assert by_gpu(tick(src, clock))[0]["gpu_util_ratio"] == s[1]["gpu_util_ratio"]
    assert "util" not in src.unsupported(0)


def test_a_failing_collector_never_stops_the_poll():
    fake = FakeNvml.node("H100", 2)
    real = fake.nvmlDeviceGetRemappedRows
    fake.nvmlDeviceGetRemappedRows = lambda h: real(h)[:3]  # a binding change: 3 values, not 4
    fake, src, _clock, hooks = make(fake)
    samples = src.poll()
    encode_all(samples)
    s = by_gpu(samples)[0]
    assert s["ecc_sbe_volatile_total"] is None  # the whole slow group is null this round
    assert s["power_w"] is not None and s["sm_clock_mhz"] == 1980
    assert src.collector_failures["slow"] == 2
    assert [g for g, _ in hooks.failures] == ["slow", "slow"]
    assert isinstance(hooks.failures[0][1], ValueError)


def test_garbage_from_mig_enumeration_never_stops_the_poll():
    fake = mig_node()
    fake, src, clock, hooks = make(fake, intervals={"mig": 5})
    src.poll()
    fake.nvmlDeviceGetMaxMigDeviceCount = lambda h: "seven"
    samples = tick(src, clock, 5.0)
    assert len(samples) == 4  # the slices known before are kept
    assert src.collector_failures["mig"] == 1  # GPU 1, the one in MIG mode
    assert [g for g, _ in hooks.failures] == ["mig"]
    assert by_gpu(samples)[0]["power_w"] is not None


def test_garbage_values_from_nvml_are_null_and_counted():
    fake, src, clock, hooks = make(FakeNvml.node("H100", 2))
    fake.set_values(
        0,
        util_gpu=255,
        util_memory=-1,  # through c_uint: 4294967295
        power_mw=float("nan"),
        gpu_temp_c=-300,
        energy_mj=-5,
        sm_clock_mhz=0xFFFFFFFF,
        memory_temp_c=float("nan"),
        fb_used=2**64 - 1,
    )
    fake.set_gpm(0, {pynvml.NVML_GPM_METRIC_SM_UTIL: 250.0, pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 100.4})
    src.poll()
    samples = tick(src, clock)
    s = by_gpu(samples)
    for f in (
        "gpu_util_ratio",
        "mem_copy_util_ratio",
        "power_w",
        "gpu_temp_c",
        "total_energy_mj",
        "sm_clock_mhz",
        "memory_temp_c",
        "sm_active_ratio",
    ):
        assert s[0][f] is None, f
        assert src.garbage_counts[f] >= 1, f
    assert s[0]["gr_engine_active_ratio"] == 1.0  # 100.4 %: rounding overshoot, clamped
    assert s[0]["mem_clock_mhz"] == 2619  # the rest of the GPU is fine
    assert s[1]["gpu_util_ratio"] == pytest.approx(0.87)  # and so are the other GPUs
    assert "power_w" in hooks.garbage_fields
    assert src.collector_failures == {}


# -- scheduling, carry-over, hooks, lookups --------------------------------------------------------


def test_slow_values_are_carried_between_slow_polls():
    fake, src, clock, _ = make(FakeNvml.node("H100", 1))
    assert by_gpu(src.poll())[0]["ecc_sbe_volatile_total"] == 5
    fake.set_values(0, ecc_sbe_volatile=6, power_mw=300_000)
    for _ in range(28):
        s = by_gpu(tick(src, clock))[0]
        assert s["ecc_sbe_volatile_total"] == 5  # slow: the last value, repeated
        assert s["power_w"] == 300.0  # fast: fresh
    assert by_gpu(tick(src, clock, 2.0))[0]["ecc_sbe_volatile_total"] == 6
    assert fake.count("nvmlDeviceGetTotalEccErrors", gpu=0) == 2 * 4


def test_hooks_see_durations_of_the_groups_that_ran():
    _fake, src, clock, hooks = make(FakeNvml.node("H100", 2))
    src.poll()
    assert sorted(g for g, _ in hooks.durations) == ["fabric", "fast", "processes", "profiling", "slow"]
    assert all(sec >= 0 for _, sec in hooks.durations)
    hooks.durations.clear()
    tick(src, clock)
    assert sorted(g for g, _ in hooks.durations) == ["fast", "profiling"]
    assert set(src.collect_seconds) == {"fabric", "fast", "processes", "profiling", "slow"}


def test_intervals_and_collectors_are_validated():
    fake = FakeNvml.node("H100", 1)
    with pytest.raises(ConfigError, match="unknown NVML interval"):
        NvmlSource(fake, "n", {"medium": 5})
    with pytest.raises(ConfigError, match="positive"):
        NvmlSource(fake, "n", {"slow": 0})
    with pytest.raises(ConfigError, match="number of seconds"):
        NvmlSource(fake, "n", {"slow": "often"})
    with pytest.raises(ConfigError, match="unknown NVML collector"):
        NvmlSource(fake, "n", collectors=("fast", "dcgm"))


def test_interval_ms_follows_the_fast_interval():
    _fake, src, _clock, _ = make(FakeNvml.node("H100", 1), intervals={"fast": 0.5})
    assert src.poll()[0]["interval_ms"] == 500


def test_bus_id_map_for_kernel_log_attribution():
    fake, src, _clock, _ = make()
    m = src.bus_id_map()
    assert len(m) == 8
    ref = m[pci.device_key("PCI:0000:c3:00")]
    assert ref.gpu_index == 5 and ref.uuid == fake.gpus[5].uuid
    assert ref.pci_bus_id == "00000000:C3:00.0" and ref.driver_version == "570.124.06"
    assert [g.gpu_index for g in src.gpus()] == list(range(8))


def test_record_xid_shows_as_last_xid():
    _fake, src, _clock, _ = make(mig_node())
    src.record_xid(0, 79)
    src.record_xid(1, 31, gpu_instance_id=2)
    samples = src.poll()
    s = by_gpu(samples)
    assert s[0]["last_xid"] == 79 and s[1]["last_xid"] == 31
    slices = {x["mig"]["gpu_instance_id"]: x for x in samples if x["mig"] is not None}
    assert slices[2]["last_xid"] == 31 and slices[1]["last_xid"] is None


def test_set_from_sample_drives_the_fake_in_contract_units():
    fake, src, clock, _ = make(FakeNvml.node("H100", 1))
    fake.set_from_sample(
        0, power_w=350.5, gpu_util_ratio=0.9, tensor_active_ratio=0.66, pcie_tx_bytes_per_s=None
    )
    src.poll()
    s = by_gpu(tick(src, clock))[0]
    assert s["power_w"] == 350.5 and s["gpu_util_ratio"] == 0.9
    assert s["tensor_active_ratio"] == pytest.approx(0.66)
    with pytest.raises(TypeError):
        fake.set_from_sample(0, hostname="x")


# -- golden fixture -------------------------------------------------------------------------------

GOLDEN = FIXTURES_DIR / "dgx_h100_mixed.expected.json"


def _golden_run() -> list[dict[str, Any]]:
    clock = FakeClock()
    fake = load_fixture("dgx_h100_mixed", clock=clock)
    src = NvmlSource(fake, "dgx-h100-07", None, clock, clock.wall)
    src.start()
    src.poll()
    clock.advance(1.0)
    samples = src.poll()
    src.shutdown()
    encode_all(samples)
    return samples


def test_golden_dgx_h100_mixed_node():
    """The whole poll output for a described node. Regenerate: GPUPIPE_REGEN_FIXTURES=1."""
    samples = _golden_run()
    text = json.dumps(samples, indent=1, sort_keys=True) + "\n"
    if os.environ.get("GPUPIPE_REGEN_FIXTURES") == "1":
        Path(GOLDEN).write_text(text)
    expected = json.loads(Path(GOLDEN).read_text())
    assert len(samples) == len(expected) == 8 + 2
    for got, want in zip(samples, expected, strict=True):
        for key in want:
            if isinstance(want[key], float):
                assert math.isclose(got[key], want[key], rel_tol=1e-12), key
            else:
                assert got[key] == want[key], (got["gpu_index"], key)
