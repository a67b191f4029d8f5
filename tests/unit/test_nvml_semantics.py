"""NVML semantics the producer review found wrong (producer-review.md 1.7, 1.8, 1.9, 1.11, §3).

Run against the project's fake NVML, kept in step with what NVIDIA's mock libnvidia-ml shows
(see tests/fixtures/nvml/README.md for what was checked against the mock by hand).
"""

from __future__ import annotations

import logging

import pynvml
import pytest

from tests.fake_nvml import FakeMigSlice, FakeNvml
from tests.unit.test_nvml_source import RecordingHooks, by_gpu, make, tick


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
    fake.gpus[0].unsupported.add("nvmlDeviceGetPowerUsage")
    _, src, clock, _ = make(fake, hooks=hooks)
    tick(src, clock)
    assert ("power", "NotSupported") in hooks.unsupported_calls
    src.shutdown()
