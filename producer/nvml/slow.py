"""Slow group (default every 30 s): memory errors and recovery state, which move rarely.

Reads ECC counters, retired pages, remapped rows, PCIe replays, the recovery action, bank
remapping, the unrepairable-memory flag and power smoothing into GpuSample fields. What a GPU or
driver answers NotSupported (or lacks) is learned once and stays null; nothing is read for a MIG slice.
More (NVML call -> field table): docs/producer.md, "The slow field group".
"""

from __future__ import annotations

import ctypes
from typing import Any

from gpupipe_producer.nvml import convert
from gpupipe_producer.nvml.base import DeviceContext, FieldSpec, read_field_values

FI_GPU_RECOVERY_ACTION = 230


# (field-values key, binding constant): the power-smoothing readings (see the module doc).
_SMOOTHING = (
    ("fi_smoothing_enabled", "NVML_FI_PWR_SMOOTHING_ENABLED"),
    ("fi_smoothing_profile", "NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE"),
    ("fi_smoothing_ceil", "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_CEIL"),
    ("fi_smoothing_floor", "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR"),
    ("fi_smoothing_lifetime", "NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING"),
)


class SlowCollector:
    name = "slow"
    fields = (
        "ecc_sbe_volatile_total",
        "ecc_dbe_volatile_total",
        "ecc_sbe_aggregate_total",
        "ecc_dbe_aggregate_total",
        "retired_pages_sbe",
        "retired_pages_dbe",
        "retired_pages_pending",
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "row_remap_pending",
        "row_remap_failure",
        "pcie_replay_count",
        "gpu_recovery_action",
        "bank_remap_pending",
        "bank_remaps_active",
        "memory_unrepairable",
        "power_smoothing_enabled",
        "power_smoothing_profile",
        "power_smoothing_tmp_ceiling_w",
        "power_smoothing_tmp_floor_w",
        "power_smoothing_lifetime_remaining_ratio",
    )

    def __init__(self, nvml: Any) -> None:
        corrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        aggregate = getattr(nvml, "NVML_AGGREGATE_ECC", 1)
        self._ecc = (
            ("ecc_sbe_volatile_total", corrected, volatile),
            ("ecc_dbe_volatile_total", uncorrected, volatile),
            ("ecc_sbe_aggregate_total", corrected, aggregate),
            ("ecc_dbe_aggregate_total", uncorrected, aggregate),
        )
        sbe_cause = getattr(nvml, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)
        dbe_cause = getattr(nvml, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)
        self._retired = (("retired_pages_sbe", sbe_cause), ("retired_pages_dbe", dbe_cause))
        self._field_specs: tuple[FieldSpec, ...] = (
            (
                "fi_recovery_action",
                getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FI_GPU_RECOVERY_ACTION),
                None,
                False,
            ),
            *(
                (key, int(getattr(nvml, const)), None, False)
                for key, const in _SMOOTHING
                if isinstance(getattr(nvml, const, None), int)
            ),
        )
        self._bank_status = getattr(nvml, "c_nvmlEccBankRemapperStatus_v1_t", None)

        self._remap_specs: tuple[FieldSpec, ...] = tuple(
            (key, int(getattr(nvml, const, default)), None, False)
            for key, const, default in (
                ("fi_remap_cor", "NVML_FI_DEV_REMAPPED_COR", 142),
                ("fi_remap_unc", "NVML_FI_DEV_REMAPPED_UNC", 143),
                ("fi_remap_pending", "NVML_FI_DEV_REMAPPED_PENDING", 144),
                ("fi_remap_failure", "NVML_FI_DEV_REMAPPED_FAILURE", 145),
            )
        )

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if ctx.is_mig:
            return out
        h, call, put = ctx.handle, ctx.call, ctx.put
        for field, err_type, counter in self._ecc:
            put(out, field, convert.count, call(field, "nvmlDeviceGetTotalEccErrors", h, err_type, counter))
        for field, cause in self._retired:
            pages = call(field, "nvmlDeviceGetRetiredPages", h, cause)
            if pages is not None:
                put(out, field, convert.count, len(pages))
        put(
            out,
            "retired_pages_pending",
            convert.flag,
            call("retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus", h),
        )
        rows = call("remapped_rows", "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, pending, failure = rows
            put(out, "remapped_rows_correctable", convert.count, corr)
            put(out, "remapped_rows_uncorrectable", convert.count, unc)
            put(out, "row_remap_pending", convert.flag, pending)
            put(out, "row_remap_failure", convert.flag, failure)
        elif ctx.mig_enabled and "remapped_rows" in ctx.unsupported:
            # nvml.h: NotSupported "on MIG-enabled GPUs with active instances". Pending / failure
            # (reset or RMA needed) must not go dark on MIG nodes: try the field ids instead.
            rv = read_field_values(ctx, self._remap_specs)
            put(out, "remapped_rows_correctable", convert.count, rv.get("fi_remap_cor"))
            put(out, "remapped_rows_uncorrectable", convert.count, rv.get("fi_remap_unc"))
            put(out, "row_remap_pending", convert.flag, rv.get("fi_remap_pending"))
            put(out, "row_remap_failure", convert.flag, rv.get("fi_remap_failure"))
        put(out, "pcie_replay_count", convert.count, call("pcie_replay", "nvmlDeviceGetPcieReplayCounter", h))
        fv = read_field_values(ctx, self._field_specs)
        put(out, "gpu_recovery_action", convert.small_int, fv.get("fi_recovery_action"))
        put(out, "power_smoothing_enabled", convert.flag, fv.get("fi_smoothing_enabled"))
        put(out, "power_smoothing_profile", convert.small_int, fv.get("fi_smoothing_profile"))
        put(out, "power_smoothing_tmp_ceiling_w", convert.watts, fv.get("fi_smoothing_ceil"))
        put(out, "power_smoothing_tmp_floor_w", convert.watts, fv.get("fi_smoothing_floor"))
        put(
            out,
            "power_smoothing_lifetime_remaining_ratio",
            convert.pct_to_ratio,
            fv.get("fi_smoothing_lifetime"),
        )
        self._memory_health(ctx, out)
        return out

    def _memory_health(self, ctx: DeviceContext, out: dict[str, Any]) -> None:
        """The bank remapper and the unrepairable-memory flag (newer drivers; learned where absent)."""
        h, call, put = ctx.handle, ctx.call, ctx.put
        if self._bank_status is None:
            ctx.learn("bank_remapper", "c_nvmlEccBankRemapperStatus_v1_t missing from the NVML binding")
        elif ctx.supported("bank_remapper"):
            status = self._bank_status()
            # the binding hands the argument to C as is: the struct goes by reference
            if (
                call("bank_remapper", "nvmlDeviceGetBankRemapperStatus_v1", h, ctypes.byref(status))
                is not None
            ):
                put(out, "bank_remap_pending", convert.flag, status.bPending)
                put(out, "bank_remaps_active", convert.count, status.activeRemappings)
        put(
            out,
            "memory_unrepairable",
            convert.flag,
            call("unrepairable_memory", "nvmlDeviceGetUnrepairableMemoryFlag_v1", h),
        )

    def release(self, ctx: DeviceContext) -> None:
        return None
