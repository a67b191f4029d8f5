"""What NVML refuses: hardware answers are learned for good, refusals about rights or versions are
asked again with back-off, and what is learned is visible."""

from __future__ import annotations

import logging
from typing import Any

import pynvml
import pytest

from gpupipe_producer.nvml.learned import Learned, refusal_kind
from tests.fake_nvml import FakeNvml, FakeProcess
from tests.unit.producer.nvml.test_semantics import UnsupportedHooks
from tests.unit.producer.nvml.test_source import by_gpu, make, tick

PROCS = "nvmlDeviceGetComputeRunningProcesses"


def _with_process(count: int = 1) -> FakeNvml:
    fake = FakeNvml.node("H100", count)
    for g in fake.gpus:
        g.processes = [FakeProcess(4242, "train.py", used_memory=GIB_8)]
    return fake


GIB_8 = 8 * 1024**3


def test_no_permission_on_the_process_list_is_asked_again_with_back_off() -> None:
    fake = _with_process()
    fake.gpus[0].fail(PROCS, pynvml.NVML_ERROR_NO_PERMISSION, times=2)
    fake, src, clock, _ = make(fake, intervals={"refused_retry": 300})
    assert by_gpu(src.poll())[0]["processes"] == []  # refused (the schema's list is not nullable)
    asked = fake.count(PROCS, gpu=0)
    for _ in range(5):
        tick(src, clock, 60.0)
    assert fake.count(PROCS, gpu=0) == asked + 1  # asked again once after 300 s, refused again
    for _ in range(5):  # the back-off doubled: 600 s
        tick(src, clock, 60.0)
    assert fake.count(PROCS, gpu=0) == asked + 1
    s = by_gpu(tick(src, clock, 300.0))[0]  # rights granted meanwhile: the next retry answers
    assert [p["pid"] for p in s["processes"]] == [4242]
    assert "procs" not in src.unsupported(0)
    src.shutdown()


def test_not_supported_is_learned_for_good() -> None:
    fake = FakeNvml.node("H100", 1)
    fake.gpus[0].unsupported.add("nvmlDeviceGetEncoderUtilization")
    fake, src, clock, _ = make(fake, intervals={"refused_retry": 300})
    src.poll()
    asked = fake.count("nvmlDeviceGetEncoderUtilization", gpu=0)
    for _ in range(30):
        tick(src, clock, 300.0)
    assert fake.count("nvmlDeviceGetEncoderUtilization", gpu=0) == asked
    assert "enc" in src.unsupported(0)
    src.shutdown()


def test_gpm_refused_for_permission_comes_back_when_allowed() -> None:
    # Review 1.8 with a fix of the rights: profiling values return without a restart.
    fake = FakeNvml.node("H100", 1)
    fake.gpus[0].fail("nvmlGpmSampleGet", pynvml.NVML_ERROR_NO_PERMISSION, times=1)
    fake, src, clock, _ = make(fake, intervals={"refused_retry": 300})
    src.poll()
    assert by_gpu(tick(src, clock))[0]["sm_active_ratio"] is None
    assert by_gpu(tick(src, clock, 300.0))[0]["sm_active_ratio"] is None  # first sample again
    assert by_gpu(tick(src, clock))[0]["sm_active_ratio"] == pytest.approx(0.8)
    src.shutdown()


def test_function_not_found_and_version_mismatch_are_retried_a_missing_binding_function_is_not() -> None:
    clock = [0.0]
    learned = Learned(lambda: clock[0], retry_s=10, retry_max_s=40)
    assert learned.add("a", refusal_kind("NVMLError_FunctionNotFound: Function Not Found")) == 10
    assert learned.add("b", refusal_kind("NVMLError_ArgumentVersionMismatch: x")) == 10
    assert learned.add("c", refusal_kind("NVMLLibraryMismatchError: x")) == 10
    assert learned.add("d", refusal_kind("nvmlDeviceGetFoo missing from the NVML binding")) is None
    assert learned.add("e", refusal_kind("nvmlGpmQueryDeviceSupport: isSupportedDevice=0")) is None
    assert set(learned) == {"a", "b", "c", "d", "e"}
    assert learned.permanent("d") and not learned.permanent("a")
    clock[0] = 10.0
    assert set(learned) == {"d", "e"} and learned.kinds() == {"d": "BindingMissing", "e": "NotSupported"}
    assert learned.add("a", "FunctionNotFound") == 20  # doubled
    assert learned.add("a", "FunctionNotFound") == 40
    assert learned.add("a", "FunctionNotFound") == 40  # capped
    learned.answered("a")
    assert learned.add("a", "FunctionNotFound") == 10  # starts over


def test_no_permission_warns_once_per_key_not_supported_stays_quiet_and_both_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = UnsupportedHooks()
    fake = _with_process(2)
    for g in fake.gpus:
        g.fail(PROCS, pynvml.NVML_ERROR_NO_PERMISSION, times=100)
        g.unsupported.add("nvmlDeviceGetEncoderUtilization")
    with caplog.at_level(logging.DEBUG, "gpupipe.nvml"):
        fake, src, clock, _ = make(fake, hooks=hooks, intervals={"refused_retry": 300})
        src.poll()
        tick(src, clock, 300.0)  # asked again, refused again: no second warning
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "refused procs" in r.getMessage()]
    assert len(warned) == 1 and "NoPermission" in warned[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "enc" in r.getMessage()]
    assert hooks.unsupported_calls.count(("procs", "NoPermission")) == 4  # 2 GPUs x 2 learns
    assert src.learned()[("procs", "NoPermission")] == 2
    assert src.learned()[("enc", "NotSupported")] == 2
    src.shutdown()


def _refuse(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    refused.__name__ = name
    return refused


@pytest.mark.parametrize(
    "where",
    ["nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet", "metric"],
)
def test_pcie_throughput_falls_back_wherever_gpm_is_refused(where: str) -> None:
    # Review 1.8: the legacy PCIe call keyed on gpm_supported only; refused at any step of GPM
    # (support query, sample buffers, sampling, metrics, or the PCIe metrics alone) PCIe went null.
    fake = FakeNvml.node("H100", 1)
    g = fake.gpus[0]
    if where == "metric":
        g.unsupported_gpm_metrics |= {
            pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
            pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
        }
    elif where in ("nvmlGpmSampleAlloc", "nvmlGpmMetricsGet"):  # not device calls: refused for all
        setattr(fake, where, _refuse(where))
    else:
        g.fail(where, pynvml.NVML_ERROR_NO_PERMISSION, times=100)
    fake, src, clock, _ = make(fake)
    src.poll()
    for _ in range(3):
        s = by_gpu(tick(src, clock))[0]
    assert s["pcie_tx_bytes_per_s"] == 123_456 * 1024.0 and s["pcie_rx_bytes_per_s"] == 654_321 * 1024.0
    assert fake.count("nvmlDeviceGetPcieThroughput", gpu=0) > 0
    src.shutdown()


def test_a_process_utilisation_answer_starts_the_rights_back_off_over() -> None:
    # Suspected finding 8: nvmlDeviceGetProcessUtilization is called directly (not through
    # ctx.call) and never said it answered, so a refusal after a success kept the doubled back-off.
    util = "nvmlDeviceGetProcessUtilization"
    fake = _with_process()
    fake.gpus[0].fail(util, pynvml.NVML_ERROR_NO_PERMISSION, times=2)
    fake, src, clock, _ = make(fake, intervals={"refused_retry": 300})
    src.poll()  # refused: asked again in 300 s
    tick(src, clock, 300.0)  # refused again: 600 s
    asked = fake.count(util, gpu=0)
    tick(src, clock, 600.0)  # rights granted: it answers
    assert fake.count(util, gpu=0) == asked + 1 and "proc_util" not in src.unsupported(0)
    fake.gpus[0].fail(util, pynvml.NVML_ERROR_NO_PERMISSION, times=1)
    tick(src, clock, 10.0)  # refused once more, after a success: the back-off starts at 300 s
    assert "proc_util" in src.unsupported(0)
    asked = fake.count(util, gpu=0)
    tick(src, clock, 300.0)
    assert fake.count(util, gpu=0) == asked + 1, "asked again after 300 s, not after a doubled 1200 s"
    assert "proc_util" not in src.unsupported(0)
    src.shutdown()
