"""Fast group (default every 1 s): utilisation, memory, power, energy, temperatures, clocks,
clock-event reasons, violation time, PCIe throughput, encoder/decoder, NVLink counter.

Reads each GPU's fast fields into GpuSample fields in the sample's units; the ``NVML_FI_*`` values
come from one ``nvmlDeviceGetFieldValues`` call per GPU per tick, a field a device does not answer
falls back to its classic call. On a MIG slice only the slice's memory is read.
More (NVML call -> field table): docs/producer.md, "The fast field group".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpupipe_producer.nvml import convert
from gpupipe_producer.nvml.base import DeviceContext, FieldSpec, read_field_values
from gpupipe_schemas.records import GPU_SAMPLE_COLLECTOR_FAST

UINT_MAX = 0xFFFFFFFF
FI_MEMORY_TEMP = 82
FI_NVLINK_DATA_TX = 138
FI_NVLINK_DATA_RX = 139
FI_PERF_POLICY_POWER = 74
FI_PERF_POLICY_THERMAL = 75
FI_TOTAL_ENERGY = 83
FI_POWER_AVERAGE = 185
FI_POWER_CURRENT_LIMIT = 190
FI_ENERGY = 191
FI_PCIE_COUNT_TX = 197
FI_PCIE_COUNT_RX = 198
SCOPE_MODULE = 1  # nvmlFieldValue_t.scopeId for power/energy: 0 GPU, 1 module (GPU + CPU + memory)
#: nvmlDeviceGetPcieThroughput reads a byte counter over 20 ms (nvml.h).
LEGACY_PCIE_WINDOW_MS = 20


class FastCollector:
    name = "fast"
    fields = GPU_SAMPLE_COLLECTOR_FAST  # the schema marks them gpupipe.collector: fast

    def __init__(
        self, nvml: Any, *, pcie_via_gpm: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``pcie_via_gpm``: leave PCIe to the GPM collector where GPM works (it is enabled)."""
        self._pcie_via_gpm = pcie_via_gpm
        self._clock = clock
        self._nvlink_tx_id = int(getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", FI_NVLINK_DATA_TX))
        self._nvlink_rx_id = int(getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", FI_NVLINK_DATA_RX))
        self._temp_gpu = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        self._clock_sm = getattr(nvml, "NVML_CLOCK_SM", 1)
        self._clock_mem = getattr(nvml, "NVML_CLOCK_MEM", 2)
        self._perf_power = getattr(nvml, "NVML_PERF_POLICY_POWER", 0)
        self._perf_thermal = getattr(nvml, "NVML_PERF_POLICY_THERMAL", 1)
        self._pcie_tx = getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0)
        self._pcie_rx = getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1)
        self._mem_v2 = getattr(nvml, "nvmlMemory_v2", None)

        def fi(name: str, default: int) -> Any:
            return getattr(nvml, name, default)

        self._field_specs: tuple[FieldSpec, ...] = (
            ("fi_power", fi("NVML_FI_DEV_POWER_AVERAGE", FI_POWER_AVERAGE), None, False),
            ("fi_power_limit", fi("NVML_FI_DEV_POWER_CURRENT_LIMIT", FI_POWER_CURRENT_LIMIT), None, False),
            ("fi_energy", fi("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", FI_TOTAL_ENERGY), None, False),
            ("fi_viol_power", fi("NVML_FI_DEV_PERF_POLICY_POWER", FI_PERF_POLICY_POWER), None, False),
            ("fi_viol_thermal", fi("NVML_FI_DEV_PERF_POLICY_THERMAL", FI_PERF_POLICY_THERMAL), None, False),
            ("fi_memory_temp", getattr(nvml, "NVML_FI_DEV_MEMORY_TEMP", FI_MEMORY_TEMP), None, False),
            # GB200/GH200 superchip module (scope 1): NotSupported elsewhere, learned once.
            ("fi_module_power", fi("NVML_FI_DEV_POWER_AVERAGE", FI_POWER_AVERAGE), SCOPE_MODULE, True),
            ("fi_module_energy", fi("NVML_FI_DEV_ENERGY", FI_ENERGY), SCOPE_MODULE, True),
            (
                "fi_nvlink_tx",
                getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", FI_NVLINK_DATA_TX),
                UINT_MAX,
                True,
            ),
            (
                "fi_nvlink_rx",
                getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", FI_NVLINK_DATA_RX),
                UINT_MAX,
                True,
            ),
        )
        # Asked only where GPM does not measure PCIe (see _pcie).
        self._pcie_specs: tuple[FieldSpec, ...] = (
            ("fi_pcie_tx_count", fi("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", FI_PCIE_COUNT_TX), None, False),
            ("fi_pcie_rx_count", fi("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", FI_PCIE_COUNT_RX), None, False),
        )

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._memory(ctx, out)
        if ctx.is_mig:
            return out
        h = ctx.handle
        put = ctx.put
        call = ctx.call

        util = call("util", "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            put(out, "gpu_util_ratio", convert.pct_to_ratio, util.gpu)
            put(out, "mem_copy_util_ratio", convert.pct_to_ratio, util.memory)
        enc = call("enc", "nvmlDeviceGetEncoderUtilization", h)
        if enc is not None:
            put(out, "enc_util_ratio", convert.pct_to_ratio, enc[0])
        dec = call("dec", "nvmlDeviceGetDecoderUtilization", h)
        if dec is not None:
            put(out, "dec_util_ratio", convert.pct_to_ratio, dec[0])

        legacy_pcie = not (self._pcie_via_gpm and _gpm_measures_pcie(ctx))
        specs = self._field_specs + self._pcie_specs if legacy_pcie else self._field_specs
        fv = read_field_values(ctx, specs)
        unsupported = ctx.unsupported

        def fielded(key: str, fallback_key: str, fn: str, *args: Any) -> Any:
            """The batched field value, or the classic call once the field is learned unsupported."""
            if key in fv:
                return fv[key]
            if key in unsupported or "field_values" in unsupported:
                return call(fallback_key, fn, h, *args)
            return None  # the batch failed this tick (counted): no second round trip

        put(out, "power_w", convert.mw_to_w, fielded("fi_power", "power", "nvmlDeviceGetPowerUsage"))
        put(
            out,
            "power_limit_w",
            convert.mw_to_w,
            fielded("fi_power_limit", "power_limit", "nvmlDeviceGetEnforcedPowerLimit"),
        )
        put(
            out,
            "total_energy_mj",
            convert.count,
            fielded("fi_energy", "energy", "nvmlDeviceGetTotalEnergyConsumption"),
        )

        temp = call("temp_v", "nvmlDeviceGetTemperatureV", h, self._temp_gpu)
        if temp is None and "temp_v" in ctx.unsupported:
            temp = call("temp", "nvmlDeviceGetTemperature", h, self._temp_gpu)
        put(out, "gpu_temp_c", convert.celsius, temp)

        sm_clock = call("clock_sm", "nvmlDeviceGetClockInfo", h, self._clock_sm)
        put(out, "sm_clock_mhz", convert.mhz, sm_clock)
        mem_clock = call("clock_mem", "nvmlDeviceGetClockInfo", h, self._clock_mem)
        put(out, "mem_clock_mhz", convert.mhz, mem_clock)
        put(
            out,
            "clock_event_reasons",
            convert.count,
            call("clock_reasons", "nvmlDeviceGetCurrentClocksEventReasons", h),
        )
        for field, key, fallback, policy in (
            ("power_violation_ns", "fi_viol_power", "viol_power", self._perf_power),
            ("thermal_violation_ns", "fi_viol_thermal", "viol_thermal", self._perf_thermal),
        ):
            viol = fielded(key, fallback, "nvmlDeviceGetViolationStatus", policy)
            put(out, field, convert.count, getattr(viol, "violationTime", viol))

        if legacy_pcie:
            self._pcie(ctx, fv, out)

        put(out, "memory_temp_c", convert.celsius, fv.get("fi_memory_temp"))
        put(out, "module_power_w", convert.mw_to_w, fv.get("fi_module_power"))
        put(out, "module_energy_mj", convert.count, fv.get("fi_module_energy"))
        tx_kib, rx_kib = fv.get("fi_nvlink_tx"), fv.get("fi_nvlink_rx")
        if (tx_kib or 0) + (rx_kib or 0) == 0 and (tx_kib is not None or rx_kib is not None):
            tx_kib, rx_kib = self._nvlink_per_link(ctx, tx_kib, rx_kib)
        if tx_kib is not None or rx_kib is not None:
            put(out, "nvlink_bandwidth_total_kib", convert.count, (tx_kib or 0) + (rx_kib or 0))
        return out

    def _nvlink_per_link(self, ctx: DeviceContext, tx: Any, rx: Any) -> tuple[Any, Any]:
        """The aggregate (scope UINT_MAX) read 0: sum the links instead when they say otherwise.

        nvml.h says UINT_MAX sums every link, but NVIDIA's mock answers 0 there while its links
        carry traffic; publishing 0 would hide it. Only asked while the aggregate is 0
        and the link count is known (the fabric group reads it), so a real driver pays nothing.
        """
        counts = ctx.state.get("link_counts")
        links = counts[0] if counts else None
        if not links:
            return tx, rx
        specs = [(f"fi_nvlink_tx:{i}", self._nvlink_tx_id, i, True) for i in range(links)]
        specs += [(f"fi_nvlink_rx:{i}", self._nvlink_rx_id, i, True) for i in range(links)]
        got = read_field_values(ctx, specs)
        txs = [v for k, v in got.items() if k.startswith("fi_nvlink_tx:")]
        rxs = [v for k, v in got.items() if k.startswith("fi_nvlink_rx:")]
        if not txs and not rxs:
            return tx, rx
        return sum(int(v) for v in txs), sum(int(v) for v in rxs)

    def _pcie(self, ctx: DeviceContext, fv: dict[str, Any], out: dict[str, Any]) -> None:
        """PCIe throughput without GPM: byte counters over the interval where NVML has them (the
        same meaning as GPM's), else the legacy 20 ms snapshot. A counter that went backwards
        (driver reload, wrap) gives no value for that interval rather than a wrong one."""
        txc, rxc = fv.get("fi_pcie_tx_count"), fv.get("fi_pcie_rx_count")
        if txc is not None and rxc is not None:
            now = self._clock()
            prev = ctx.state.get("pcie_counts")
            ctx.state["pcie_counts"] = (now, int(txc), int(rxc))
            if prev is not None and now > prev[0] and txc >= prev[1] and rxc >= prev[2]:
                dt = now - prev[0]
                out["pcie_tx_bytes_per_s"] = (int(txc) - prev[1]) / dt
                out["pcie_rx_bytes_per_s"] = (int(rxc) - prev[2]) / dt
                out["pcie_window_ms"] = max(1, round(dt * 1000))
            return
        if "fi_pcie_tx_count" not in ctx.unsupported and "fi_pcie_rx_count" not in ctx.unsupported:
            return  # the batch failed this tick (counted): no snapshot of another kind
        h, call, put = ctx.handle, ctx.call, ctx.put
        tx = call("pcie_tx", "nvmlDeviceGetPcieThroughput", h, self._pcie_tx)
        put(out, "pcie_tx_bytes_per_s", convert.kib_per_s_to_bytes_per_s, tx)
        rx = call("pcie_rx", "nvmlDeviceGetPcieThroughput", h, self._pcie_rx)
        put(out, "pcie_rx_bytes_per_s", convert.kib_per_s_to_bytes_per_s, rx)
        if tx is not None or rx is not None:
            out["pcie_window_ms"] = LEGACY_PCIE_WINDOW_MS

    def _memory(self, ctx: DeviceContext, out: dict[str, Any]) -> None:
        mem = None
        if self._mem_v2 is not None:
            mem = ctx.call("mem_v2", "nvmlDeviceGetMemoryInfo", ctx.handle, version=self._mem_v2)
        if mem is None and (self._mem_v2 is None or "mem_v2" in ctx.unsupported):
            mem = ctx.call("mem_v1", "nvmlDeviceGetMemoryInfo", ctx.handle)
        if mem is None:
            return
        ctx.put(out, "fb_total_bytes", convert.count, mem.total)
        ctx.put(out, "fb_free_bytes", convert.count, mem.free)
        ctx.put(out, "fb_used_bytes", convert.count, mem.used)
        reserved = getattr(mem, "reserved", None)
        ctx.put(out, "fb_reserved_bytes", convert.count, reserved)

    def release(self, ctx: DeviceContext) -> None:
        return None


#: Any of these learned means GPM does not deliver PCIe bytes here (refused sampling included).
_GPM_PCIE_KEYS = ("gpm", "gpm_alloc", "gpm_sample", "gpm_metrics", "gpm_metric:20", "gpm_metric:21")


def _gpm_measures_pcie(ctx: DeviceContext) -> bool:
    """GPM (Hopper+) measures PCIe over the whole interval; the legacy call samples 20 ms.

    When GPM sampling is refused (NoPermission for a caller without profiling rights) the legacy
    counter is read instead, so PCIe throughput does not vanish with the profiling metrics.
    """
    return bool(ctx.gpm_supported) and not any(k in ctx.unsupported for k in _GPM_PCIE_KEYS)
