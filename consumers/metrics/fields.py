"""dcgm-exporter field names -> GpuSample fields, with dcgm-exporter's units (pure data).

Every ``DCGM_FI_*`` field a GpuSample carries has one :class:`FieldSpec`: the sample field it reads,
the conversion (``Kind``) to dcgm-exporter's unit and text format, and the TYPE and HELP of
dcgm-exporter's counters CSV. Fields DCGM has but GpuSample lacks are listed in :data:`UNAVAILABLE`,
so a stock counters CSV loads with a warning.
More (units table, special fields): docs/inside-metrics.md, "fields.py".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class Kind(enum.IntEnum):
    """How a GpuSample value becomes dcgm-exporter's value (see the module table)."""

    INT = 0
    ROUND = 1
    PERCENT = 2
    MIB = 3
    FLOAT = 4
    BOOL = 5
    XID_LAST = 6  # DCGM_FI_DEV_XID_ERRORS: store state, not a sample column alone
    XID_TOTAL = 7  # DCGM_EXP_XID_ERRORS_TOTAL: store state
    LABEL = 8  # a `label` row
    XID_COUNT = 9  # DCGM_EXP_XID_ERRORS_COUNT: XIDs per code in the last --xid-count-window-size
    CLOCK_COUNT = 10  # DCGM_EXP_CLOCK_EVENTS_COUNT: samples per clock-event bit in the window
    CLOCK_TOTAL = 11  # DCGM_EXP_CLOCK_EVENTS_TOTAL: rising edges per clock-event bit
    HEALTH = 12  # DCGM_EXP_GPU_HEALTH_STATUS: one series per DCGM health watch
    HERTZ = 13  # an int MHz reading as Hz (x 10**6): DCGM 4.7's *_CLOCK_HERTZ fields
    JOULES = 14  # an int mJ reading as whole J (// 1000): DCGM 4.7's *_ENERGY_JOULES_TOTAL (INT64)
    KIB = 15  # an int KiB reading as bytes (x 1024)

    @property
    def exp(self) -> bool:
        """Exporter-derived (``DCGM_EXP_*``-style) families: several lines per GPU, store state."""
        return self in _EXP_KINDS


_EXP_KINDS = frozenset(
    {Kind.XID_LAST, Kind.XID_TOTAL, Kind.XID_COUNT, Kind.CLOCK_COUNT, Kind.CLOCK_TOTAL, Kind.HEALTH}
)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One dcgm-exporter field we can serve."""

    name: str  # DCGM field name, e.g. DCGM_FI_DEV_GPU_UTIL (the metric name)
    source: str | None  # GpuSample field, None for store-state fields
    kind: Kind
    prom_type: str  # default TYPE: gauge | counter | label
    help: str  # default HELP
    per_pod: str | None = None  # GpuProcess field summed per pod on shared GPUs (see render.py)
    signed: bool = False  # negative values are plausible (temperatures); else a negative value is dropped
    renames: str | None = None  # the dcgm-exporter <= 4.8 name this spec is the newer name of (dialect.py)

    @property
    def is_label(self) -> bool:
        return self.kind is Kind.LABEL


def _f(
    name: str,
    source: str | None,
    kind: Kind,
    prom_type: str,
    help_: str,
    per_pod: str | None = None,
    signed: bool = False,
) -> FieldSpec:
    return FieldSpec(name, source, kind, prom_type, help_, per_pod, signed)


_PCIE_TX = "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second."  # noqa: E501
_RECOVERY = (
    "Recommended GPU recovery action (0 none; 1 GPU reset; 2 node reboot; 3 drain P2P; 4 drain and reset)."
)
_PCIE_RX = "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second."  # noqa: E501

#: Every field we serve, in the order of dcgm-exporter's default counters CSV (then the extras).
#: HELP/TYPE text as in that CSV (dcgm-exporter etc/default-counters.csv, 4.8.3-era) where present.
FIELDS: tuple[FieldSpec, ...] = (
    # Clocks
    _f("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", Kind.INT, "gauge", "SM clock frequency (in MHz)."),
    _f("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz", Kind.INT, "gauge", "Memory clock frequency (in MHz)."),
    # Temperature
    _f(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "memory_temp_c",
        Kind.ROUND,
        "gauge",
        "Memory temperature (in C).",
        signed=True,
    ),
    _f("DCGM_FI_DEV_GPU_TEMP", "gpu_temp_c", Kind.ROUND, "gauge", "GPU temperature (in C).", signed=True),
    # Power
    _f("DCGM_FI_DEV_POWER_USAGE", "power_w", Kind.FLOAT, "gauge", "Power draw (in W)."),
    _f(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "total_energy_mj",
        Kind.INT,
        "counter",
        "Total energy consumption since boot (in mJ).",
    ),
    # PCIe
    _f(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "pcie_replay_count",
        Kind.INT,
        "counter",
        "Total number of PCIe retries.",
    ),
    # Utilization
    _f(
        "DCGM_FI_DEV_GPU_UTIL",
        "gpu_util_ratio",
        Kind.PERCENT,
        "gauge",
        "GPU utilization (in %).",
        "sm_util_ratio",
    ),
    _f(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "mem_copy_util_ratio",
        Kind.PERCENT,
        "gauge",
        "Memory utilization (in %).",
        "mem_util_ratio",
    ),
    _f("DCGM_FI_DEV_ENC_UTIL", "enc_util_ratio", Kind.PERCENT, "gauge", "Encoder utilization (in %)."),
    _f("DCGM_FI_DEV_DEC_UTIL", "dec_util_ratio", Kind.PERCENT, "gauge", "Decoder utilization (in %)."),
    # Errors and violations
    _f(
        "DCGM_FI_DEV_XID_ERRORS",
        "last_xid",
        Kind.XID_LAST,
        "gauge",
        "Value of the last XID error encountered.",
    ),
    _f(
        "DCGM_FI_DEV_POWER_VIOLATION",
        "power_violation_ns",
        Kind.INT,
        "counter",
        "Throttling duration due to power constraints (in ns).",
    ),
    _f(
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "thermal_violation_ns",
        Kind.INT,
        "counter",
        "Throttling duration due to thermal constraints (in ns).",
    ),
    _f(
        "DCGM_EXP_XID_ERRORS_TOTAL",
        None,
        Kind.XID_TOTAL,
        "counter",
        "Total XID errors observed since exporter start.",
    ),
    _f(
        "DCGM_EXP_XID_ERRORS_COUNT",
        None,
        Kind.XID_COUNT,
        "gauge",
        "XID errors observed during the configured time window.",
    ),
    _f(
        "DCGM_EXP_CLOCK_EVENTS_COUNT",
        "clock_event_reasons",
        Kind.CLOCK_COUNT,
        "gauge",
        "Clock events observed during the configured time window.",
    ),
    _f(
        "DCGM_EXP_CLOCK_EVENTS_TOTAL",
        "clock_event_reasons",
        Kind.CLOCK_TOTAL,
        "counter",
        "Total clock events observed since exporter start (edge-counted).",
    ),
    _f(
        "DCGM_EXP_GPU_HEALTH_STATUS",
        None,
        Kind.HEALTH,
        "gauge",
        "Current DCGM-reported GPU health status.",
    ),
    # Memory usage
    _f("DCGM_FI_DEV_FB_FREE", "fb_free_bytes", Kind.MIB, "gauge", "Framebuffer memory free (in MiB)."),
    _f(
        "DCGM_FI_DEV_FB_USED",
        "fb_used_bytes",
        Kind.MIB,
        "gauge",
        "Framebuffer memory used (in MiB).",
        "used_memory_bytes",
    ),
    _f(
        "DCGM_FI_DEV_FB_RESERVED",
        "fb_reserved_bytes",
        Kind.MIB,
        "gauge",
        "Framebuffer memory reserved (in MiB).",
    ),
    # ECC
    _f(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "ecc_sbe_volatile_total",
        Kind.INT,
        "counter",
        "Total number of single-bit volatile ECC errors.",
    ),
    _f(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "ecc_dbe_volatile_total",
        Kind.INT,
        "counter",
        "Total number of double-bit volatile ECC errors.",
    ),
    _f(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "ecc_sbe_aggregate_total",
        Kind.INT,
        "counter",
        "Total number of single-bit persistent ECC errors.",
    ),
    _f(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "ecc_dbe_aggregate_total",
        Kind.INT,
        "counter",
        "Total number of double-bit persistent ECC errors.",
    ),
    # Retired pages
    _f(
        "DCGM_FI_DEV_RETIRED_SBE",
        "retired_pages_sbe",
        Kind.INT,
        "counter",
        "Total number of retired pages due to single-bit errors.",
    ),
    _f(
        "DCGM_FI_DEV_RETIRED_DBE",
        "retired_pages_dbe",
        Kind.INT,
        "counter",
        "Total number of retired pages due to double-bit errors.",
    ),
    _f(
        "DCGM_FI_DEV_RETIRED_PENDING",
        "retired_pages_pending",
        Kind.BOOL,
        "counter",
        "Total number of pages pending retirement.",
    ),
    # NVLink
    _f(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "nvlink_bandwidth_total_kib",
        Kind.INT,
        "gauge",
        "Total number of NVLink bandwidth counters for all lanes.",
    ),
    # NVLink error totals over all links (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL, to Hopper): one
    # flapping link shows here, never in the bandwidth. HELP and TYPE as dcgm-exporter's CSV rows.
    _f(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "nvlink_crc_flit_errors_total",
        Kind.INT,
        "counter",
        "Total number of NVLink flow-control CRC errors.",
    ),
    _f(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "nvlink_crc_data_errors_total",
        Kind.INT,
        "counter",
        "Total number of NVLink data CRC errors.",
    ),
    _f(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "nvlink_replay_errors_total",
        Kind.INT,
        "counter",
        "Total number of NVLink retries.",
    ),
    _f(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "nvlink_recovery_errors_total",
        Kind.INT,
        "counter",
        "Total number of NVLink recovery errors.",
    ),
    # vGPU license
    _f("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "vgpu_license_status", Kind.INT, "gauge", "vGPU License status"),
    # Remapped rows
    _f(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "remapped_rows_uncorrectable",
        Kind.INT,
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    _f(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "remapped_rows_correctable",
        Kind.INT,
        "counter",
        "Number of remapped rows for correctable errors",
    ),
    _f(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "row_remap_failure",
        Kind.BOOL,
        "gauge",
        "Whether remapping of rows has failed",
    ),
    # Static configuration, as a label
    _f("DCGM_FI_DRIVER_VERSION", "driver_version", Kind.LABEL, "label", "Driver Version"),
    _f("DCGM_FI_NVML_VERSION", "nvml_version", Kind.LABEL, "label", "NVML Version"),
    _f("DCGM_FI_DEV_BRAND", "brand", Kind.LABEL, "label", "Device Brand"),
    _f("DCGM_FI_DEV_SERIAL", "serial", Kind.LABEL, "label", "Device Serial Number"),
    _f("DCGM_FI_DEV_VBIOS_VERSION", "vbios_version", Kind.LABEL, "label", "VBIOS version of the device"),
    _f(
        "DCGM_FI_DEV_INFOROM_IMAGE_VER", "inforom_image_version", Kind.LABEL, "label", "Inforom image version"
    ),
    _f("DCGM_FI_DEV_UUID", "uuid", Kind.LABEL, "label", "Device UUID"),
    _f("DCGM_FI_DEV_NAME", "model_name", Kind.LABEL, "label", "Device name"),
    _f("DCGM_FI_DEV_PCI_BUSID", "pci_bus_id", Kind.LABEL, "label", "PCI bus id"),
    # Datacenter profiling (DCP)
    _f(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gr_engine_active_ratio",
        Kind.FLOAT,
        "gauge",
        "Ratio of time the graphics engine is active.",
    ),
    _f(
        "DCGM_FI_PROF_SM_ACTIVE",
        "sm_active_ratio",
        Kind.FLOAT,
        "gauge",
        "The ratio of cycles an SM has at least 1 warp assigned.",
    ),
    _f(
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "sm_occupancy_ratio",
        Kind.FLOAT,
        "gauge",
        "The ratio of number of warps resident on an SM.",
    ),
    _f(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "tensor_active_ratio",
        Kind.FLOAT,
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
    ),
    _f(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "dram_active_ratio",
        Kind.FLOAT,
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
    ),
    _f(
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        "fp64_active_ratio",
        Kind.FLOAT,
        "gauge",
        "Ratio of cycles the fp64 pipes are active.",
    ),
    _f(
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        "fp32_active_ratio",
        Kind.FLOAT,
        "gauge",
        "Ratio of cycles the fp32 pipes are active.",
    ),
    _f(
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        "fp16_active_ratio",
        Kind.FLOAT,
        "gauge",
        "Ratio of cycles the fp16 pipes are active.",
    ),
    _f("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_s", Kind.ROUND, "gauge", _PCIE_TX),
    _f("DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx_bytes_per_s", Kind.ROUND, "gauge", _PCIE_RX),
    # Not in dcgm-exporter's CSV at all: our own HELP text.
    _f(
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "nvlink_tx_bytes_per_s",
        Kind.ROUND,
        "gauge",
        "The rate of data transmitted over NVLink - including both protocol headers and data payloads - "
        "in bytes per second.",
    ),
    _f(
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "nvlink_rx_bytes_per_s",
        Kind.ROUND,
        "gauge",
        "The rate of data received over NVLink - including both protocol headers and data payloads - "
        "in bytes per second.",
    ),
    _f("DCGM_FI_DEV_FB_TOTAL", "fb_total_bytes", Kind.MIB, "gauge", "Framebuffer memory total (in MiB)."),
    _f(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT", "power_limit_w", Kind.FLOAT, "gauge", "Power management limit (in W)."
    ),
    _f(
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
        "power_limit_w",
        Kind.FLOAT,
        "gauge",
        "Effective power limit that the driver enforces (in W).",
    ),
    _f(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "clock_event_reasons",
        Kind.INT,
        "gauge",
        "Current clock event reasons (bitmask of DCGM_CLOCKS_EVENT_REASON_*).",
    ),
    _f(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "clock_event_reasons",
        Kind.INT,
        "gauge",
        "Current clock throttle reasons (bitmask; deprecated name of DCGM_FI_DEV_CLOCKS_EVENT_REASONS).",
    ),
    _f(
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "row_remap_pending",
        Kind.BOOL,
        "gauge",
        "Whether remapping of rows is pending (a GPU reset applies it).",
    ),
    _f(
        "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION",
        "gpu_recovery_action",
        Kind.INT,
        "gauge",
        _RECOVERY,
    ),
    _f(
        "DCGM_FI_DEV_GPU_RECOVERY_ACTION",
        "gpu_recovery_action",
        Kind.INT,
        "gauge",
        _RECOVERY,
    ),
    # Power smoothing (Blackwell+; DCGM 4.x dcgm_fields.h 1425-1438): absent where NVML does not answer
    _f(
        "DCGM_FI_DEV_PWR_SMOOTHING_ENABLED",
        "power_smoothing_enabled",
        Kind.BOOL,
        "gauge",
        "Power smoothing enablement (0 disabled; 1 enabled).",
    ),
    _f(
        "DCGM_FI_DEV_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE",
        "power_smoothing_profile",
        Kind.INT,
        "gauge",
        "Active power smoothing preset profile number.",
    ),
    _f(
        "DCGM_FI_DEV_PWR_SMOOTHING_APPLIED_TMP_CEIL",
        "power_smoothing_tmp_ceiling_w",
        Kind.FLOAT,
        "gauge",
        "Applied TMP ceiling value (in W).",
    ),
    _f(
        "DCGM_FI_DEV_PWR_SMOOTHING_APPLIED_TMP_FLOOR",
        "power_smoothing_tmp_floor_w",
        Kind.FLOAT,
        "gauge",
        "Applied TMP floor value (in W).",
    ),
    _f(
        "DCGM_FI_DEV_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING",
        "power_smoothing_lifetime_remaining_ratio",
        Kind.PERCENT,
        "gauge",
        "Power smoothing HW circuitry lifetime remaining (in %).",
    ),
)

BY_NAME: Mapping[str, FieldSpec] = MappingProxyType({f.name: f for f in FIELDS})

#: DCGM field names that are valid for dcgm-exporter but have no GpuSample source. A counters CSV
#: naming one of these loads with a warning and the row is skipped (dcgm-exporter does the same for
#: profiling fields a GPU does not support); any *other* unknown name is a configuration error.
UNAVAILABLE: frozenset[str] = frozenset(
    {
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
        "DCGM_FI_DEV_RELIABILITY_VIOLATION",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0",
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        "DCGM_FI_DEV_POWER_USAGE_INSTANT",
        "DCGM_FI_DEV_FB_USED_PERCENT",
        "DCGM_FI_DEV_COUNT",
        "DCGM_EXP_P2P_STATUS",
        "DCGM_FI_DEV_OEM_INFOROM_VER",
        "DCGM_FI_DEV_ECC_INFOROM_VER",
        "DCGM_FI_DEV_POWER_INFOROM_VER",
        "DCGM_FI_PROF_PIPE_INT_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE",
        "DCGM_FI_PROF_SM_CYCLES_ELAPSED_TOTAL",
        "DCGM_FI_PROF_SM_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_MMA_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_DMMA_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_HMMA_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_IMMA_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_DFMA_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_PCIE_TX_BYTES_TOTAL",
        "DCGM_FI_PROF_PCIE_RX_BYTES_TOTAL",
        "DCGM_FI_PROF_INT_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_FP64_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_FP32_CYCLES_ACTIVE_TOTAL",
        "DCGM_FI_PROF_FP16_CYCLES_ACTIVE_TOTAL",
    }
)


#: dcgm-exporter's 1.x metric names (``etc/1.x-compatibility-metrics.csv``, resolved by go-dcgm's
#: legacy field map) -> the DCGM field they read. The metric keeps the 1.x name.
LEGACY: Mapping[str, str] = MappingProxyType(
    {
        "dcgm_sm_clock": "DCGM_FI_DEV_SM_CLOCK",
        "dcgm_memory_clock": "DCGM_FI_DEV_MEM_CLOCK",
        "dcgm_memory_temp": "DCGM_FI_DEV_MEMORY_TEMP",
        "dcgm_gpu_temp": "DCGM_FI_DEV_GPU_TEMP",
        "dcgm_power_usage": "DCGM_FI_DEV_POWER_USAGE",
        "dcgm_total_energy_consumption": "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "dcgm_pcie_tx_throughput": "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "dcgm_pcie_rx_throughput": "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        "dcgm_pcie_replay_counter": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "dcgm_gpu_utilization": "DCGM_FI_DEV_GPU_UTIL",
        "dcgm_mem_copy_utilization": "DCGM_FI_DEV_MEM_COPY_UTIL",
        "dcgm_enc_utilization": "DCGM_FI_DEV_ENC_UTIL",
        "dcgm_dec_utilization": "DCGM_FI_DEV_DEC_UTIL",
        "dcgm_xid_errors": "DCGM_FI_DEV_XID_ERRORS",
        "dcgm_power_violation": "DCGM_FI_DEV_POWER_VIOLATION",
        "dcgm_thermal_violation": "DCGM_FI_DEV_THERMAL_VIOLATION",
        "dcgm_sync_boost_violation": "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
        "dcgm_board_limit_violation": "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
        "dcgm_low_util_violation": "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
        "dcgm_reliability_violation": "DCGM_FI_DEV_RELIABILITY_VIOLATION",
        "dcgm_fb_free": "DCGM_FI_DEV_FB_FREE",
        "dcgm_fb_used": "DCGM_FI_DEV_FB_USED",
        "dcgm_ecc_sbe_volatile_total": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "dcgm_ecc_dbe_volatile_total": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "dcgm_ecc_sbe_aggregate_total": "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "dcgm_ecc_dbe_aggregate_total": "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "dcgm_retired_pages_sbe": "DCGM_FI_DEV_RETIRED_SBE",
        "dcgm_retired_pages_dbe": "DCGM_FI_DEV_RETIRED_DBE",
        "dcgm_retired_pages_pending": "DCGM_FI_DEV_RETIRED_PENDING",
        "dcgm_nvlink_flit_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "dcgm_nvlink_data_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "dcgm_nvlink_replay_error_count_total": "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "dcgm_nvlink_recovery_error_count_total": "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "dcgm_nvlink_bandwidth_total": "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "dcgm_fi_prof_gr_engine_active": "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "dcgm_fi_prof_sm_active": "DCGM_FI_PROF_SM_ACTIVE",
        "dcgm_fi_prof_sm_occupancy": "DCGM_FI_PROF_SM_OCCUPANCY",
        "dcgm_fi_prof_pipe_tensor_active": "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "dcgm_fi_prof_dram_active": "DCGM_FI_PROF_DRAM_ACTIVE",
        "dcgm_fi_prof_pcie_tx_bytes": "DCGM_FI_PROF_PCIE_TX_BYTES",
        "dcgm_fi_prof_pcie_rx_bytes": "DCGM_FI_PROF_PCIE_RX_BYTES",
    }
)

#: Prefixes of names dcgm-exporter can accept (DCGM fields, exporter collectors, 1.x names): a
#: name with one of them that we cannot serve is *unsupported* (listed, service runs); any other
#: name is a typo and a startup error.
DCGM_PREFIXES = ("DCGM_FI_", "DCGM_EXP_", "dcgm_")


def lookup(name: str) -> FieldSpec | None:
    """The spec for a DCGM field name (or a 1.x legacy name), or None when we cannot serve it."""
    spec = BY_NAME.get(name)
    if spec is None and name in LEGACY:
        spec = BY_NAME.get(LEGACY[name])
    return spec
