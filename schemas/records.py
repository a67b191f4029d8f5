"""The contract's records as types: a TypedDict per Avro record, and the schema's field groups.

Generated from schemas/*.avsc by gpupipe_schemas.codegen; do not edit by hand. Regenerate with
`.venv/bin/python -m gpupipe_schemas.codegen` (or `make contract`); `--check` fails on drift.
"""

from typing import Literal, NotRequired, TypeAlias, TypedDict

ChargebackRecordKind: TypeAlias = Literal["window", "correction"]


ChargebackPriceSource: TypeAlias = Literal["exact", "pattern", "default"]


class WorkloadShare(TypedDict):
    """Avro record gpupipe.v1.WorkloadShare."""

    owner_kind: NotRequired[str | None]
    owner_name: NotRequired[str | None]
    labels: NotRequired[dict[str, str]]
    hpc_job: NotRequired[str | None]
    claim_name: NotRequired[str | None]
    allocated_gpu_seconds: float
    used_gpu_seconds: float
    idle_gpu_seconds: float
    energy_joules: float
    cost_allocation: float
    cost_energy: float
    cost_total: float


class ChargebackWindow(TypedDict):
    """Avro record gpupipe.v1.ChargebackWindow."""

    kind: ChargebackRecordKind
    window_start_ms: int
    window_end_ms: int
    namespace: str
    team: NotRequired[str | None]
    node: str
    gpu_model: str
    allocated_gpu_seconds: float
    used_gpu_seconds: float
    idle_gpu_seconds: float
    activity_unknown_gpu_seconds: NotRequired[float]
    shared_gpu_seconds: NotRequired[float]
    mig_gpu_seconds: NotRequired[float]
    lost_gpu_seconds: NotRequired[float]
    energy_joules: float
    energy_estimated_joules: NotRequired[float]
    sample_count: int
    price_per_gpu_hour: float
    price_per_kwh: float
    price_source: ChargebackPriceSource
    cost_allocation: float
    cost_energy: float
    cost_total: float
    currency: str
    source_partition: int
    instance_id: str
    emitted_at_ms: int
    workloads: NotRequired[list[WorkloadShare]]
    record_id: NotRequired[str | None]
    late_offsets: NotRequired[list[int]]


AlertStatus: TypeAlias = Literal["unknown", "firing", "resolved", "action"]


AlertScope: TypeAlias = Literal["unknown", "gpu", "node", "nvswitch"]


AlertSeverity: TypeAlias = Literal["info", "warning", "critical"]


AlertCauseClass: TypeAlias = Literal[
    "unknown",
    "application",
    "driver",
    "hardware_memory",
    "nvlink_fabric",
    "thermal_power",
    "bus",
]


RecommendedAction: TypeAlias = Literal[
    "UNKNOWN",
    "RESTART_APP",
    "RESET_GPU",
    "RESTART_BM",
    "RESTART_VM",
    "CONTACT_SUPPORT",
    "CHECK_MECHANICALS",
    "CHECK_UVM",
    "UPDATE_SWFW",
    "IGNORE",
    "WORKFLOW_XID_45",
    "WORKFLOW_XID_48",
    "WORKFLOW_NVLINK_ERR",
    "WORKFLOW_NVLINK5_ERR",
    "XID_154",
    "DRAIN_AND_RESET",
    "DRAIN_P2P",
    "RESTART_FM",
    "RUN_DCGMEUD",
    "RUN_FIELDDIAG",
    "BUS_RESET",
    "SYSTEM_REBOOT",
]


class AlertPod(TypedDict):
    """Avro record gpupipe.v1.AlertPod."""

    namespace: str
    pod: str
    container: NotRequired[str]


RemediationKind: TypeAlias = Literal["unknown", "cordon", "ack", "evidence"]


RemediationOutcome: TypeAlias = Literal[
    "unknown",
    "cordoned",
    "already_cordoned",
    "dry_run",
    "rate_limited",
    "failed",
    "acknowledged",
    "recorded",
]


class Remediation(TypedDict):
    """Avro record gpupipe.v1.Remediation."""

    kind: RemediationKind
    outcome: RemediationOutcome
    node: str
    dry_run: bool
    detail: NotRequired[str]
    at_ms: int


class RecoveryPending(TypedDict):
    """Avro record gpupipe.v1.RecoveryPending."""

    evidence: str
    since_ms: int
    detail: NotRequired[str]


class GpuAlert(TypedDict):
    """Avro record gpupipe.v1.GpuAlert."""

    alert_id: str
    status: AlertStatus
    sequence: int
    scope: AlertScope
    alertname: str
    signal: str
    severity: AlertSeverity
    xid_codes: NotRequired[list[int]]
    name: str
    summary: str
    description: str
    cause_class: AlertCauseClass
    action: RecommendedAction
    nvidia_action: NotRequired[RecommendedAction | None]
    drain_node: bool
    known: NotRequired[bool]
    rule: NotRequired[str]
    catalog_version: NotRequired[str]
    hostname: str
    gpu_uuid: NotRequired[str | None]
    gpu_index: NotRequired[int | None]
    pci_bus_id: NotRequired[str | None]
    model_name: NotRequired[str | None]
    driver_version: NotRequired[str | None]
    mig_uuid: NotRequired[str | None]
    gpus: NotRequired[list[str]]
    allocations: NotRequired[list[AlertPod]]
    namespaces: NotRequired[list[str]]
    first_seen_ms: int
    last_seen_ms: int
    occurrences: int
    first_event_id: NotRequired[str | None]
    last_event_id: NotRequired[str | None]
    message: NotRequired[str]
    runbook: str
    parent_alert_id: NotRequired[str | None]
    emitted_at_ms: int
    resolved_at_ms: NotRequired[int | None]
    resolve_reason: NotRequired[str | None]
    remediation: NotRequired[Remediation | None]
    instance: NotRequired[str]
    boot_id: NotRequired[str | None]
    recovery_pending: NotRequired[RecoveryPending | None]
    last_event_partition: NotRequired[int | None]
    last_event_offset: NotRequired[int | None]


RecommendationStatus: TypeAlias = Literal["unknown", "firing", "resolved"]


GpuRecommendationRecommendedAction: TypeAlias = Literal[
    "unknown",
    "release",
    "right_size_mig",
    "shared_gpu",
    "cheaper_model",
]


class GpuRecommendation(TypedDict):
    """Avro record gpupipe.v1.GpuRecommendation."""

    recommendation_id: str
    sequence: int
    status: RecommendationStatus
    resolve_reason: NotRequired[str | None]
    timestamp_ms: int
    hostname: str
    uuid: str
    mig_uuid: NotRequired[str | None]
    gpu_index: NotRequired[int | None]
    model_name: str
    mig_profile: NotRequired[str | None]
    gpu_fraction: float
    resource_name: NotRequired[str | None]
    namespace: str
    pod: str
    container: NotRequired[str | None]
    owner_kind: NotRequired[str | None]
    owner_name: NotRequired[str | None]
    team: NotRequired[str | None]
    labels: NotRequired[dict[str, str]]
    idle_since_ms: int
    last_seen_ms: int
    idle_seconds: float
    gpu_hours_idle: float
    cost_wasted: float
    currency: str
    idle_threshold: float
    activity_peak_ratio: NotRequired[float | None]
    memory_peak_bytes: NotRequired[int | None]
    memory_total_bytes: NotRequired[int | None]
    action: GpuRecommendationRecommendedAction
    target: NotRequired[str | None]
    saving_per_hour: NotRequired[float | None]
    message: str


class MigIdentity(TypedDict):
    """Avro record gpupipe.v1.MigIdentity."""

    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    slice_fraction: float


class PodAllocation(TypedDict):
    """Avro record gpupipe.v1.PodAllocation."""

    namespace: str
    pod: str
    container: str
    resource_name: NotRequired[str | None]
    replica: NotRequired[int | None]
    owner_kind: NotRequired[str | None]
    owner_name: NotRequired[str | None]
    labels: NotRequired[dict[str, str]]
    priority_class: NotRequired[str | None]
    metadata_status: NotRequired[str | None]
    hpc_job: NotRequired[str | None]
    claim_name: NotRequired[str | None]
    claim_namespace: NotRequired[str | None]
    dra_pool: NotRequired[str | None]
    dra_device: NotRequired[str | None]
    dra_share_id: NotRequired[str | None]


class GpuProcess(TypedDict):
    """Avro record gpupipe.v1.GpuProcess."""

    pid: int
    process_name: NotRequired[str | None]
    used_memory_bytes: NotRequired[int | None]
    sm_util_ratio: NotRequired[float | None]
    mem_util_ratio: NotRequired[float | None]
    namespace: NotRequired[str | None]
    pod: NotRequired[str | None]
    container: NotRequired[str | None]


class NvLinkCounters(TypedDict):
    """Avro record gpupipe.v1.NvLinkCounters."""

    link: int
    up: NotRequired[bool | None]
    peer: NotRequired[str | None]
    crc_flit: NotRequired[int | None]
    crc_data: NotRequired[int | None]
    replay: NotRequired[int | None]
    recovery: NotRequired[int | None]
    rcv: NotRequired[int | None]
    symbol: NotRequired[int | None]
    recovery_failed: NotRequired[int | None]


class GpuSample(TypedDict):
    """Avro record gpupipe.v1.GpuSample."""

    timestamp_ms: int
    hostname: str
    gpu_index: int
    uuid: str
    pci_bus_id: str
    model_name: str
    driver_version: NotRequired[str | None]
    numa_node: NotRequired[int | None]
    mig: NotRequired[MigIdentity | None]
    mig_enabled: NotRequired[bool | None]
    allocations: NotRequired[list[PodAllocation]]
    processes: NotRequired[list[GpuProcess]]
    interval_ms: NotRequired[int | None]
    gpu_lost: NotRequired[bool]
    gpu_util_ratio: NotRequired[float | None]
    mem_copy_util_ratio: NotRequired[float | None]
    enc_util_ratio: NotRequired[float | None]
    dec_util_ratio: NotRequired[float | None]
    fb_total_bytes: NotRequired[int | None]
    fb_free_bytes: NotRequired[int | None]
    fb_used_bytes: NotRequired[int | None]
    fb_reserved_bytes: NotRequired[int | None]
    power_w: NotRequired[float | None]
    power_limit_w: NotRequired[float | None]
    power_smoothing_enabled: NotRequired[bool | None]
    power_smoothing_profile: NotRequired[int | None]
    power_smoothing_tmp_ceiling_w: NotRequired[float | None]
    power_smoothing_tmp_floor_w: NotRequired[float | None]
    power_smoothing_lifetime_remaining_ratio: NotRequired[float | None]
    total_energy_mj: NotRequired[int | None]
    gpu_temp_c: NotRequired[float | None]
    memory_temp_c: NotRequired[float | None]
    sm_clock_mhz: NotRequired[int | None]
    mem_clock_mhz: NotRequired[int | None]
    clock_event_reasons: NotRequired[int | None]
    power_violation_ns: NotRequired[int | None]
    thermal_violation_ns: NotRequired[int | None]
    pcie_tx_bytes_per_s: NotRequired[float | None]
    pcie_rx_bytes_per_s: NotRequired[float | None]
    pcie_replay_count: NotRequired[int | None]
    nvlink_bandwidth_total_kib: NotRequired[int | None]
    vgpu_license_status: NotRequired[int | None]
    last_xid: NotRequired[int | None]
    ecc_sbe_volatile_total: NotRequired[int | None]
    ecc_dbe_volatile_total: NotRequired[int | None]
    ecc_sbe_aggregate_total: NotRequired[int | None]
    ecc_dbe_aggregate_total: NotRequired[int | None]
    retired_pages_sbe: NotRequired[int | None]
    retired_pages_dbe: NotRequired[int | None]
    retired_pages_pending: NotRequired[bool | None]
    remapped_rows_correctable: NotRequired[int | None]
    remapped_rows_uncorrectable: NotRequired[int | None]
    row_remap_pending: NotRequired[bool | None]
    row_remap_failure: NotRequired[bool | None]
    gpu_recovery_action: NotRequired[int | None]
    bank_remap_pending: NotRequired[bool | None]
    bank_remaps_active: NotRequired[int | None]
    memory_unrepairable: NotRequired[bool | None]
    gr_engine_active_ratio: NotRequired[float | None]
    sm_active_ratio: NotRequired[float | None]
    sm_occupancy_ratio: NotRequired[float | None]
    tensor_active_ratio: NotRequired[float | None]
    dram_active_ratio: NotRequired[float | None]
    fp64_active_ratio: NotRequired[float | None]
    fp32_active_ratio: NotRequired[float | None]
    fp16_active_ratio: NotRequired[float | None]
    nvlink_tx_bytes_per_s: NotRequired[float | None]
    nvlink_rx_bytes_per_s: NotRequired[float | None]
    serial: NotRequired[str | None]
    vbios_version: NotRequired[str | None]
    brand: NotRequired[str | None]
    nvml_version: NotRequired[str | None]
    inforom_image_version: NotRequired[str | None]
    pcie_window_ms: NotRequired[int | None]
    allocations_stale: NotRequired[bool]
    fabric_state: NotRequired[str | None]
    fabric_health: NotRequired[str | None]
    fabric_health_mask: NotRequired[int | None]
    fabric_clique_id: NotRequired[int | None]
    fabric_cluster_uuid: NotRequired[str | None]
    nvlink_links: NotRequired[int | None]
    nvlink_links_up: NotRequired[int | None]
    nvlink_rcv_errors_total: NotRequired[int | None]
    nvlink_symbol_errors_total: NotRequired[int | None]
    nvlink_recovery_failed_total: NotRequired[int | None]
    c2c_links: NotRequired[int | None]
    c2c_links_up: NotRequired[int | None]
    module_power_w: NotRequired[float | None]
    module_energy_mj: NotRequired[int | None]
    platform_chassis_serial: NotRequired[str | None]
    platform_slot: NotRequired[int | None]
    platform_tray: NotRequired[int | None]
    platform_host_id: NotRequired[int | None]
    platform_module_id: NotRequired[int | None]
    allocations_known: NotRequired[bool]
    mig_configured_fraction: NotRequired[float | None]
    nvlink_crc_flit_errors_total: NotRequired[int | None]
    nvlink_crc_data_errors_total: NotRequired[int | None]
    nvlink_replay_errors_total: NotRequired[int | None]
    nvlink_recovery_errors_total: NotRequired[int | None]
    nvlink_link_counters: NotRequired[list[NvLinkCounters]]
    shared_replicas: NotRequired[int | None]
    mig_parent_energy_mj: NotRequired[int | None]
    mig_energy_by_slice: NotRequired[bool]
    vendor: NotRequired[str]
    profiling_source: NotRequired[str | None]


NvLinkState: TypeAlias = Literal["unknown", "inactive", "active", "sleep", "active_traffic_disabled"]


NvLinkRemoteType: TypeAlias = Literal["unknown", "gpu", "switch", "ibmnpu"]


class NvLink(TypedDict):
    """Avro record gpupipe.v1.NvLink."""

    link: int
    state: NotRequired[NvLinkState | None]
    remote_type: NotRequired[NvLinkRemoteType | None]
    remote_pci_bus_id: NotRequired[str | None]
    peer_uuid: NotRequired[str | None]


class TopologyGpu(TypedDict):
    """Avro record gpupipe.v1.TopologyGpu."""

    gpu_index: int
    uuid: str
    pci_bus_id: NotRequired[str | None]
    gpu_lost: NotRequired[bool]
    numa_node: NotRequired[int | None]
    memory_numa_node: NotRequired[int | None]
    cpu_affinity: NotRequired[str | None]
    nvlinks: NotRequired[list[NvLink]]
    nvlink_domain: NotRequired[int | None]


PcieAncestorLevel: TypeAlias = Literal[
    "unknown",
    "internal",
    "single",
    "multiple",
    "hostbridge",
    "node",
    "system",
]


class GpuPair(TypedDict):
    """Avro record gpupipe.v1.GpuPair."""

    gpu_a: int
    gpu_b: int
    pcie_ancestor: NotRequired[PcieAncestorLevel | None]
    nvlink_p2p: NotRequired[bool | None]


class GpuTopology(TypedDict):
    """Avro record gpupipe.v1.GpuTopology."""

    hostname: str
    timestamp_ms: int
    driver_version: NotRequired[str | None]
    gpus: list[TopologyGpu]
    pairs: NotRequired[list[GpuPair]]


XidKind: TypeAlias = Literal[
    "unknown",
    "xid",
    "sxid",
    "fallen_off_bus",
    "gpu_lost",
    "recovery_action",
    "gpu_unavailable",
    "driver_loaded",
    "operational",
]


XidSource: TypeAlias = Literal["unknown", "nvml", "kmsg", "nvml_kmsg", "simulated"]


class OperationalContext(TypedDict):
    """Avro record gpupipe.v1.OperationalContext."""

    context_type: int
    source_context_type: NotRequired[int | None]
    format_version: NotRequired[int | None]
    legacy_xid: NotRequired[int | None]
    data: NotRequired[bytes | None]


class OperationalEvent(TypedDict):
    """Avro record gpupipe.v1.OperationalEvent."""

    module_signature: str
    module_event_code: int
    category_id: int
    category: NotRequired[str | None]
    severity: int
    log_level: int
    scope: int
    originator: int
    attributes: NotRequired[int]
    module_instance: NotRequired[int | None]
    chiplet_id: NotRequired[int | None]
    trace_id: int
    instance_id: NotRequired[int | None]
    group_cursor: NotRequired[int | None]
    group_size: NotRequired[int | None]
    group_index: NotRequired[int | None]
    group_attributes: NotRequired[int | None]
    driver_timestamp_us: NotRequired[int | None]
    legacy_xid: NotRequired[int | None]
    legacy_sources: NotRequired[list[str]]
    contexts: NotRequired[list[OperationalContext]]


class XidEvent(TypedDict):
    """Avro record gpupipe.v1.XidEvent."""

    event_id: str
    timestamp_ms: int
    hostname: str
    kind: XidKind
    xid: NotRequired[int | None]
    pci_bus_id: str
    gpu_index: NotRequired[int | None]
    uuid: NotRequired[str | None]
    model_name: NotRequired[str | None]
    driver_version: NotRequired[str | None]
    pid: NotRequired[int | None]
    process_name: NotRequired[str | None]
    message: NotRequired[str]
    gpu_instance_id: NotRequired[int | None]
    compute_instance_id: NotRequired[int | None]
    mig_uuid: NotRequired[str | None]
    source: XidSource
    allocations: NotRequired[list[PodAllocation]]
    boot_id: NotRequired[str | None]
    vendor: NotRequired[str]
    operational: NotRequired[OperationalEvent | None]


#: Any top-level record a topic carries.
AnyRecord: TypeAlias = ChargebackWindow | GpuAlert | GpuRecommendation | GpuSample | GpuTopology | XidEvent


#: GpuProcess fields with gpupipe.bound = ratio.
GPU_PROCESS_BOUND_RATIO: tuple[str, ...] = ("sm_util_ratio", "mem_util_ratio")


#: GpuSample fields with gpupipe.bound = finite.
GPU_SAMPLE_BOUND_FINITE: tuple[str, ...] = (
    "power_limit_w",
    "power_smoothing_tmp_ceiling_w",
    "power_smoothing_tmp_floor_w",
    "pcie_tx_bytes_per_s",
    "pcie_rx_bytes_per_s",
    "nvlink_tx_bytes_per_s",
    "nvlink_rx_bytes_per_s",
)


#: GpuSample fields with gpupipe.bound = non_negative.
GPU_SAMPLE_BOUND_NON_NEGATIVE: tuple[str, ...] = (
    "fb_total_bytes",
    "fb_free_bytes",
    "fb_used_bytes",
    "power_smoothing_profile",
    "total_energy_mj",
    "bank_remaps_active",
    "module_energy_mj",
    "mig_parent_energy_mj",
)


#: GpuSample fields with gpupipe.bound = power.
GPU_SAMPLE_BOUND_POWER: tuple[str, ...] = ("power_w", "module_power_w")


#: GpuSample fields with gpupipe.bound = ratio.
GPU_SAMPLE_BOUND_RATIO: tuple[str, ...] = (
    "gpu_util_ratio",
    "mem_copy_util_ratio",
    "enc_util_ratio",
    "dec_util_ratio",
    "power_smoothing_lifetime_remaining_ratio",
    "gr_engine_active_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "tensor_active_ratio",
    "dram_active_ratio",
    "fp64_active_ratio",
    "fp32_active_ratio",
    "fp16_active_ratio",
    "mig_configured_fraction",
)


#: GpuSample fields with gpupipe.bound = temperature.
GPU_SAMPLE_BOUND_TEMPERATURE: tuple[str, ...] = ("gpu_temp_c", "memory_temp_c")


#: GpuSample fields with gpupipe.collector = fast.
GPU_SAMPLE_COLLECTOR_FAST: tuple[str, ...] = (
    "gpu_util_ratio",
    "mem_copy_util_ratio",
    "enc_util_ratio",
    "dec_util_ratio",
    "fb_total_bytes",
    "fb_free_bytes",
    "fb_used_bytes",
    "fb_reserved_bytes",
    "power_w",
    "power_limit_w",
    "total_energy_mj",
    "gpu_temp_c",
    "memory_temp_c",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "clock_event_reasons",
    "power_violation_ns",
    "thermal_violation_ns",
    "pcie_tx_bytes_per_s",
    "pcie_rx_bytes_per_s",
    "nvlink_bandwidth_total_kib",
    "pcie_window_ms",
    "module_power_w",
    "module_energy_mj",
)


#: GpuSample fields with gpupipe.mig = own.
GPU_SAMPLE_MIG_OWN: tuple[str, ...] = (
    "gpu_util_ratio",
    "mem_copy_util_ratio",
    "enc_util_ratio",
    "dec_util_ratio",
    "fb_total_bytes",
    "fb_free_bytes",
    "fb_used_bytes",
    "fb_reserved_bytes",
    "gr_engine_active_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "tensor_active_ratio",
    "dram_active_ratio",
    "fp64_active_ratio",
    "fp32_active_ratio",
    "fp16_active_ratio",
)
