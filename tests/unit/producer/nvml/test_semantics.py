"""NVML semantics the producer review found wrong.

Run against the project's fake NVML, kept in step with what NVIDIA's mock libnvidia-ml shows
(see tests/fixtures/nvml/README.md for what was checked against the mock by hand).
"""

from __future__ import annotations

import logging

import pynvml
import pytest

from tests.fake_nvml import FakeMigSlice, FakeNvml, FakeProcess
from tests.unit.producer.nvml.test_source import RecordingHooks, by_gpu, make, tick


class UnsupportedHooks(RecordingHooks):
    def __init__(self) -> None:
        super().__init__()
        self.unsupported_calls: list[tuple[str, str]] = []

    def unsupported(self, call: str, reason: str) -> None:
        self.unsupported_calls.append((call, reason))


def test_mig_enabled_after_start_gets_profiling_on_its_slices() -> None:
    # Review 1.7: slices created after a runtime MIG mode change copied gpm_supported=None.
    fake, src, clock, _ = make(FakeNvml.node("H100", 1), intervals={"mig": 2})
    src.poll()
    assert by_gpu(tick(src, clock))[0]["sm_active_ratio"] == pytest.approx(0.8)
    fake.gpus[0].enable_mig([FakeMigSlice("3g.40gb", 1, index=0), FakeMigSlice("4g.40gb", 2, index=1)])
    tick(src, clock, 2.0)  # re-enumerated: new slices, first GPM sample
    samples = tick(src, clock)
    slices = [s for s in samples if s["mig"] is not None]
    assert [s["mig"]["profile"] for s in slices] == ["3g.40gb", "4g.40gb"]
    assert all(s["sm_active_ratio"] is not None for s in slices), slices
    assert fake.count("nvmlGpmMigSampleGet") > 0
    src.shutdown()


def test_gpm_refused_is_reported_and_pcie_falls_back_to_the_legacy_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Review 1.8: NoPermission on nvmlGpmSampleGet was learned silently at DEBUG, and PCIe went null.
    hooks = UnsupportedHooks()
    fake = FakeNvml.node("H100", 2)
    for g in fake.gpus:
        g.fail("nvmlGpmSampleGet", pynvml.NVML_ERROR_NO_PERMISSION, times=1000)
    with caplog.at_level(logging.WARNING, "gpupipe.nvml"):
        fake, src, clock, _ = make(fake, hooks=hooks)
        src.poll()
        s = by_gpu(tick(src, clock))
    assert s[0]["sm_active_ratio"] is None
    assert s[0]["pcie_tx_bytes_per_s"] == 123_456 * 1024.0 and s[1]["pcie_rx_bytes_per_s"] is not None
    assert fake.count("nvmlDeviceGetPcieThroughput") > 0
    assert hooks.unsupported_calls.count(("gpm_sample", "NoPermission")) == 2  # per device
    warned = [r for r in caplog.records if "refused gpm_sample" in r.getMessage()]
    assert len(warned) == 1, "one warning per call and reason, not one per GPU or tick"
    src.shutdown()


def test_not_supported_stays_quiet_but_counted() -> None:
    hooks = UnsupportedHooks()
    fake = FakeNvml.node("H100", 1)
    fake.gpus[0].unsupported.add("nvmlDeviceGetEncoderUtilization")
    _, src, clock, _ = make(fake, hooks=hooks)
    tick(src, clock)
    assert ("enc", "NotSupported") in hooks.unsupported_calls
    src.shutdown()


def test_no_process_samples_is_no_samples_not_an_error() -> None:
    # Review 1.9a: pynvml raises NVMLError(NVML_SUCCESS) on every idle GPU (the mock does this).
    hooks = UnsupportedHooks()
    fake = FakeNvml.node("H100", 2)
    for g in fake.gpus:
        g.processes = [FakeProcess(100 + g.index, "idle", sm_util=None, mem_util=None)]
    assert fake.gpus[0].no_process_samples_code == pynvml.NVML_SUCCESS
    _, src, clock, _ = make(fake, hooks=hooks)
    src.poll()
    for _ in range(3):
        s = by_gpu(tick(src, clock, 5.0))
    assert hooks.errors == [] and src.error_counts == {}
    assert s[0]["processes"][0]["sm_util_ratio"] is None
    assert "proc_util" not in src.unsupported(0)


def test_a_bursty_process_is_weighted_by_sample_coverage() -> None:
    # Review 1.9b: NVML returns a sample only for periods in which the process was busy; one busy
    # period out of 30 in a 5 s window is 1/30 of the window, not 100 %.
    fake = FakeNvml.node("H100", 2)
    period = 166_667  # 1/6 s, an H100's utilisation sample period
    t0 = 1_000_000
    for g in fake.gpus:
        g.processes = [FakeProcess(7, "bursty")]
        g.util_samples = [(t0, 7, 100, 50)]
    fake.gpus[0].util_periods = [t0]
    _, src, clock, _ = make(fake)
    src.poll()  # primes lastSeen at t0
    # GPU 0: NVML counts the periods (nvmlDeviceGetSamples); GPU 1: NotSupported (as the mock),
    # the period is learned from the spacing of process samples and the window is estimated.
    fake.gpus[0].util_periods = [t0 + k * period for k in range(31)]
    fake.gpus[0].util_samples = [(t0 + 15 * period, 7, 100, 50)]
    fake.gpus[1].util_samples = [(t0 + 29 * period, 7, 100, 50), (t0 + 30 * period, 7, 100, 50)]
    s = by_gpu(tick(src, clock, 5.0))
    p0, p1 = s[0]["processes"][0], s[1]["processes"][0]
    assert p0["sm_util_ratio"] == pytest.approx(1 / 30) and p0["mem_util_ratio"] == pytest.approx(0.5 / 30)
    assert p1["sm_util_ratio"] == pytest.approx(2 / 30, rel=0.05), "two busy periods of 30"


def test_graphics_and_mps_clients_are_counted() -> None:
    # Review 1.9c: only compute processes were read (Omniverse on L40S, MPS tenants were invisible).
    fake = FakeNvml.node("L40S", 1)
    g = fake.gpus[0]
    g.processes = [FakeProcess(10, "nvidia-cuda-mps-server")]
    g.graphics_processes = [FakeProcess(11, "omniverse-kit"), FakeProcess(10, "nvidia-cuda-mps-server")]
    g.mps_processes = [FakeProcess(12, "tenant-a"), FakeProcess(13, "tenant-b")]
    for p in (11, 12, 13):
        fake.process_names[p] = {11: "omniverse-kit", 12: "tenant-a", 13: "tenant-b"}[p]
    _, src, _clock, _ = make(fake)
    s = by_gpu(src.poll())[0]
    assert sorted(p["pid"] for p in s["processes"]) == [10, 11, 12, 13]
    src.shutdown()


def test_the_fast_group_is_one_field_values_call_with_fallbacks_per_field() -> None:
    # Review 1.12 / §3: power, limit, energy, violation counters (the replacements of the
    # deprecated nvmlDeviceGetViolationStatus), memory temperature and NVLink in one call.
    fake = FakeNvml.node("H100", 2)
    fake.gpus[1].unsupported_fields |= {
        pynvml.NVML_FI_DEV_PERF_POLICY_POWER,
        pynvml.NVML_FI_DEV_POWER_AVERAGE,
    }
    _, src, clock, _ = make(fake, collectors=("fast",))
    src.poll()
    fake.reset_counts()
    for _ in range(5):
        s = by_gpu(tick(src, clock))
    assert fake.count("nvmlDeviceGetFieldValues", gpu=0) == 5
    for name in (
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetViolationStatus",
    ):
        assert fake.count(name, gpu=0) == 0, name
    # GPU 1 refuses two fields: only those fall back to their classic (deprecated) calls.
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=1) == 5
    assert fake.count("nvmlDeviceGetViolationStatus", gpu=1) == 5  # power policy only
    for g in (0, 1):
        assert s[g]["power_w"] == pytest.approx(512.345) and s[g]["power_violation_ns"] is not None
        assert s[g]["thermal_violation_ns"] is not None and s[g]["total_energy_mj"] is not None
    src.shutdown()


def test_numa_node_is_the_node_the_gpu_is_attached_to(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # §3: nvmlDeviceGetNumaNodeId is the GPU's own NUMA node (GPU memory onlined, GB200) and
    # NotSupported on x86; the schema means the CPU-side node the GPU is attached to.
    fake = FakeNvml.node("H100", 2)
    fake.gpus[0].numa_node, fake.gpus[0].gpu_numa_node = 1, 4
    fake.gpus[1].numa_node = 0
    bdf = fake.gpus[1].pci_bus_id.lower()[4:-2]  # 00000000:xx:00.0 -> 0000:xx:00
    (tmp_path / (bdf + ".0")).mkdir()
    (tmp_path / (bdf + ".0") / "numa_node").write_text("3\n")  # the kernel's view wins
    _, src, _clock, _ = make(fake, sysfs_pci=str(tmp_path))
    s = by_gpu(src.poll())
    assert (s[0]["numa_node"], s[1]["numa_node"]) == (1, 3)
    assert fake.count("nvmlDeviceGetNumaNodeId") == 0
    src.shutdown()


def test_a_gpu_lost_before_start_keeps_its_identity_and_unusable_ones_are_counted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Review 1.11: lost at start was published with uuid="" and pci_bus_id="".
    fake = FakeNvml.node("H100", 3)
    lost = fake.gpus[1]
    lost.lost = True
    for g in fake.gpus:
        d = tmp_path / g.pci_bus_id.lower()[4:]
        d.mkdir()
        (d / "information").write_text(f"Model: NVIDIA H100\nGPU UUID: {g.uuid}\nDevice Minor: {g.minor}\n")
    hooks = UnsupportedHooks()
    _, src, _clock, _ = make(fake, hooks=hooks, driver_gpus_dir=str(tmp_path))
    s = by_gpu(src.poll())
    assert s[1]["gpu_lost"] is True
    assert (s[1]["uuid"], s[1]["pci_bus_id"]) == (lost.uuid, lost.pci_bus_id)
    src.shutdown()
    broken = FakeNvml.node("H100", 2)
    broken.gpus[1].lost = False
    real = broken.nvmlDeviceGetHandleByIndex

    def refuse(index: int):  # type: ignore[no-untyped-def]
        if index == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_POWER)
        return real(index)

    broken.nvmlDeviceGetHandleByIndex = refuse  # type: ignore[method-assign]
    hooks2 = UnsupportedHooks()
    _, src2, _c, _ = make(broken, hooks=hooks2)
    assert src2.unusable_gpus == 1 and hooks2.errors == ["NVMLError_InsufficientPower"]
    src2.shutdown()


def test_pcie_throughput_has_one_meaning_where_nvml_has_byte_counters() -> None:
    # §3 / 1.12: GPM gives an average over the interval, nvmlDeviceGetPcieThroughput a 20 ms
    # snapshot (and may block 20 ms per call). Byte counters (FI 197/198) give the interval average
    # without GPM; pcie_window_ms says what is behind the value on every generation.
    fake = FakeNvml.node("A100", 2)
    g0 = fake.gpus[0]
    g0.pcie_tx_count_bytes, g0.pcie_rx_count_bytes = 10**12, 5 * 10**11
    _, src, clock, _ = make(fake, collectors=("fast",))
    first = by_gpu(src.poll())
    assert first[0]["pcie_tx_bytes_per_s"] is None, "one read is not a rate"
    g0.pcie_tx_count_bytes += 3 * 10**9
    g0.pcie_rx_count_bytes += 10**9
    s = by_gpu(tick(src, clock, 2.0))
    assert s[0]["pcie_tx_bytes_per_s"] == pytest.approx(1.5e9) and s[0][
        "pcie_rx_bytes_per_s"
    ] == pytest.approx(5e8)
    assert s[0]["pcie_window_ms"] == 2000
    assert fake.count("nvmlDeviceGetPcieThroughput", gpu=0) == 0
    assert s[1]["pcie_tx_bytes_per_s"] == 123_456 * 1024.0 and s[1]["pcie_window_ms"] == 20  # legacy
    g0.pcie_tx_count_bytes = 5  # a driver reload reset the counter: no value, never a negative rate
    assert by_gpu(tick(src, clock))[0]["pcie_tx_bytes_per_s"] is None
    src.shutdown()


def test_row_remapping_pending_is_seen_on_a_gpu_in_mig_mode() -> None:
    # §2: nvmlDeviceGetRemappedRows is NotSupported in MIG mode with instances, so a pending remap
    # (reset needed) or a remap failure (RMA) went dark on MIG nodes. The field ids still answer.
    fake = FakeNvml.node("H100", 1)
    g = fake.gpus[0]
    g.enable_mig([FakeMigSlice("3g.40gb", 1, index=0)])
    g.remap_pending, g.remap_failure = 1, 0
    _, src, _clock, _ = make(fake)
    s = by_gpu(src.poll())[0]
    assert s["mig_enabled"] is True and "remapped_rows" in src.unsupported(0)
    assert (s["row_remap_pending"], s["row_remap_failure"], s["remapped_rows_correctable"]) == (
        True,
        False,
        3,
    )
    src.shutdown()


def test_nvlink_total_is_summed_per_link_when_the_aggregate_reads_zero() -> None:
    # §2: NVIDIA's mock answers 0 for scope UINT_MAX while per-link counters read ~1e13 KiB; the
    # producer published 0. Per-link sums are used while the aggregate says 0 and links exist.
    fake = FakeNvml.node("H100", 2)
    fake.gpus[0].nvlink_aggregate_zero = True
    _, src, clock, _ = make(fake)
    src.poll()
    s = by_gpu(tick(src, clock))
    total0, total1 = s[0]["nvlink_bandwidth_total_kib"], s[1]["nvlink_bandwidth_total_kib"]
    assert total0 > 0 and total0 == pytest.approx(total1, rel=1e-4)  # the fake splits totals per link
    src.shutdown()
