"""DCGM_FI_PROF_* on GPUs older than Hopper: absent from the exposition, never 0.

dcgm-exporter reads them from DCGM's profiling module (Volta and newer); the node agent has only
NVML's GPM, which Hopper introduced. Chain checked here end to end: the node agent's NVML source on the
fake A100 and L40S (tests/fake_nvml) leaves the ratios null, and the store prints no line for a null,
so `DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` is absent (the dashboard's "Tensor Core Utilization" is empty, an
absent() alert fires) rather than a misleading 0. PCIe bytes stay, from NVML's throughput counter.
"""

from __future__ import annotations

import pytest

from gpupipe_consumers.metrics.collectors_csv import load_counters
from gpupipe_consumers.metrics.store import SeriesStore
from tests.fake_nvml import FakeNvml, load_fixture
from tests.paths import TESTS
from tests.unit.producer.nvml.test_source import by_gpu, make, tick

FIX = TESTS / "fixtures" / "metrics" / "dcgm-exporter" / "dcp-metrics-included-4.8.2.csv"


@pytest.mark.parametrize("gpus", ["a100", "l40s", "h100"])
def test_profiling_families_absent_before_hopper(gpus: str) -> None:
    fake = {
        "a100": lambda: load_fixture("a100_ampere"),
        "l40s": lambda: FakeNvml.node("L40S", 2),
        "h100": lambda: FakeNvml.node("H100", 2),
    }[gpus]()
    _, src, clock, _ = make(fake)
    src.poll()
    sample = by_gpu(tick(src, clock))[0]
    store = SeriesStore(load_counters(FIX), stale_after_s=1e9)
    store.apply_sample(sample, 0, sample["timestamp_ms"] / 1000)
    text = store.render(sample["timestamp_ms"] / 1000).decode()
    prof = {ln.split("{", 1)[0] for ln in text.splitlines() if ln.startswith("DCGM_FI_PROF_")}
    ratios = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE"}
    pcie = {"DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES"}
    assert prof == (ratios | pcie if gpus == "h100" else pcie)
    assert "DCGM_FI_DEV_GPU_TEMP{" in text  # the GPU is there (a family without a line has no HELP,
    # as in dcgm-exporter, whose families come from the values it got)
