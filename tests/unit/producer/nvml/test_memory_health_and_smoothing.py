"""The newer NVML reads of the slow group: bank remapper, unrepairable memory, power smoothing.

Each goes through the real pynvml call shape against the NVML double (a struct by reference for the
bank remapper, the binding's field ids for power smoothing); a driver or binding without them leaves
the fields null and the sample whole.
"""

from __future__ import annotations

import types

import pynvml

from gpupipe_producer.nvml.base import DeviceContext
from gpupipe_producer.nvml.slow import SlowCollector
from tests.fake_nvml import FakeNvml
from tests.unit.producer.nvml.test_source import by_gpu, make, tick

_NEW = (
    "bank_remap_pending",
    "bank_remaps_active",
    "memory_unrepairable",
    "power_smoothing_enabled",
    "power_smoothing_profile",
    "power_smoothing_tmp_ceiling_w",
    "power_smoothing_tmp_floor_w",
    "power_smoothing_lifetime_remaining_ratio",
)


def test_bank_remapper_and_unrepairable_memory_are_read() -> None:
    fake = FakeNvml.node("H100", 2)
    g = fake.gpus[0]
    g.bank_remap_pending, g.bank_remaps_active, g.memory_unrepairable = 1, 4, 1
    _, src, clock, _ = make(fake)
    s = by_gpu(tick(src, clock))
    assert (s[0]["bank_remap_pending"], s[0]["bank_remaps_active"], s[0]["memory_unrepairable"]) == (
        True,
        4,
        True,
    )
    # GPU 1: a driver without either call (the double's default, as NVIDIA's mock): null, learned once
    assert (s[1]["bank_remap_pending"], s[1]["memory_unrepairable"]) == (None, None)
    assert {"bank_remapper", "unrepairable_memory"} <= set(src.unsupported(1))
    before = fake.count("nvmlDeviceGetBankRemapperStatus_v1", gpu=1)
    tick(src, clock, 60.0)
    assert fake.count("nvmlDeviceGetBankRemapperStatus_v1", gpu=1) == before
    src.shutdown()


def test_power_smoothing_is_read_where_supported_and_null_elsewhere() -> None:
    fake = FakeNvml.node("H100", 2)
    fake.gpus[0].power_smoothing = {
        pynvml.NVML_FI_PWR_SMOOTHING_ENABLED: 1,
        pynvml.NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE: 2,
        pynvml.NVML_FI_PWR_SMOOTHING_APPLIED_TMP_CEIL: 1200,
        pynvml.NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR: 700,
        pynvml.NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING: 93,
    }
    _, src, clock, _ = make(fake)
    s = by_gpu(tick(src, clock))
    assert [s[0][f] for f in _NEW[3:]] == [True, 2, 1200.0, 700.0, 0.93]
    assert [s[1][f] for f in _NEW[3:]] == [None] * 5
    src.shutdown()


def test_a_driver_without_the_functions_never_breaks_the_sample() -> None:
    fake = FakeNvml.node("H100", 1)
    g = fake.gpus[0]
    g.bank_remap_pending, g.memory_unrepairable = 0, 0
    # an older libnvidia-ml.so: the binding finds no such symbol
    g.fail("nvmlDeviceGetBankRemapperStatus_v1", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    g.fail("nvmlDeviceGetUnrepairableMemoryFlag_v1", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    _, src, clock, hooks = make(fake)
    s = by_gpu(tick(src, clock))[0]
    assert (s["bank_remap_pending"], s["memory_unrepairable"]) == (None, None)
    assert s["ecc_dbe_volatile_total"] is not None and not hooks.failures
    src.shutdown()


class _OldBinding(types.ModuleType):
    """The double seen through an nvidia-ml-py that predates these calls, structs and field ids."""

    _GONE = frozenset(
        {
            "nvmlDeviceGetBankRemapperStatus_v1",
            "c_nvmlEccBankRemapperStatus_v1_t",
            "nvmlDeviceGetUnrepairableMemoryFlag_v1",
            "NVML_FI_PWR_SMOOTHING_ENABLED",
            "NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE",
            "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_CEIL",
            "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR",
            "NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING",
        }
    )

    def __init__(self, inner: FakeNvml) -> None:
        super().__init__("pynvml")
        self._inner = inner

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name in self._GONE:
            raise AttributeError(name)
        return getattr(self._inner, name)


class _Quiet:
    def error(self, kind: str) -> None: ...

    def garbage(self, field: str) -> None: ...

    def learned(self, ctx: DeviceContext, key: str, reason: str) -> None: ...


def test_an_older_binding_leaves_the_fields_null() -> None:
    fake = FakeNvml.node("H100", 1)
    g = fake.gpus[0]
    g.bank_remap_pending, g.memory_unrepairable = 1, 1
    g.power_smoothing = {pynvml.NVML_FI_PWR_SMOOTHING_ENABLED: 1}
    old = _OldBinding(fake)
    _, src, _clock, _ = make(fake)  # initialises the double
    ctx = DeviceContext(old, 0, fake.nvmlDeviceGetHandleByIndex(0), _Quiet())
    out = SlowCollector(old).collect(ctx)
    assert not set(_NEW) & set(out)
    assert out["gpu_recovery_action"] == 0
    assert {"bank_remapper", "unrepairable_memory"} <= set(ctx.unsupported)
    src.shutdown()
