"""GpuSample decoding for the alerts service: only the fields alerts and the contract check read.

Rules and reasons in full: docs/alerts.md, "Module notes", ``sample_decode.py``.
"""

from __future__ import annotations

import copy
from typing import Any

from gpupipe_schemas import catalog
from gpupipe_schemas.codec import SINGLE_OBJECT_MAGIC, AvroCodec, Decoded
from gpupipe_schemas.fastdecode import CORRUPT, SampleDecoder, writer_fields

__all__ = ["ALERT_FIELDS", "CONTRACT_FIELDS", "SAMPLE_FIELDS", "STRING_FIELDS", "AlertsDecoder"]

#: Read by health_signals (observe, health), recovery_policy.sample_healthy, admission.device_of
#: and the service's node check; a test runs them on a sample that records what they read.
ALERT_FIELDS = frozenset(
    {
        "timestamp_ms",
        "hostname",
        "gpu_index",
        "uuid",
        "pci_bus_id",
        "model_name",
        "driver_version",
        "mig",
        "allocations",
        "gpu_lost",
        "ecc_dbe_volatile_total",
        "ecc_sbe_volatile_total",
        "ecc_dbe_aggregate_total",
        "ecc_sbe_aggregate_total",
        "total_energy_mj",
        "row_remap_failure",
        "row_remap_pending",
        "bank_remap_pending",
        "memory_unrepairable",
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "gpu_recovery_action",
        "clock_event_reasons",
        "gpu_temp_c",
        "nvlink_links",
        "nvlink_link_counters",
        "fabric_clique_id",
    }
)
#: What :func:`gpupipe_schemas.validate.violation` reads of a GpuSample (its bounded fields).
CONTRACT_FIELDS = frozenset(
    {
        "timestamp_ms",
        "hostname",
        "uuid",
        "pci_bus_id",
        "model_name",
        "driver_version",
        "allocations",
        "gpu_util_ratio",
        "mem_copy_util_ratio",
        "enc_util_ratio",
        "dec_util_ratio",
        "gr_engine_active_ratio",
        "sm_active_ratio",
        "sm_occupancy_ratio",
        "tensor_active_ratio",
        "dram_active_ratio",
        "fp64_active_ratio",
        "fp32_active_ratio",
        "fp16_active_ratio",
        "mig_configured_fraction",
        "mig",
        "power_w",
        "module_power_w",
        "power_limit_w",
        "power_smoothing_profile",
        "power_smoothing_tmp_ceiling_w",
        "power_smoothing_tmp_floor_w",
        "power_smoothing_lifetime_remaining_ratio",
        "bank_remaps_active",
        "gpu_temp_c",
        "memory_temp_c",
        "pcie_tx_bytes_per_s",
        "pcie_rx_bytes_per_s",
        "nvlink_tx_bytes_per_s",
        "nvlink_rx_bytes_per_s",
        "total_energy_mj",
        "module_energy_mj",
        "mig_parent_energy_mj",
        "fb_total_bytes",
        "fb_used_bytes",
        "fb_free_bytes",
        "shared_replicas",
        "last_xid",
        "processes",
    }
)


def _holds_string(shape: Any) -> bool:
    if isinstance(shape, str):
        return shape == "string"
    if isinstance(shape, list):
        return any(_holds_string(b) for b in shape)
    if shape[0] == "record":
        return any(_holds_string(t) for _, t in shape[1])
    if shape[0] in ("array", "map"):
        return shape[0] == "map" or _holds_string(shape[1])
    return False


_CURRENT = catalog.current("GpuSample")
#: Fields of the current GpuSample that hold a string anywhere inside.
STRING_FIELDS = frozenset(n for n, t in writer_fields(_CURRENT.raw) or () if _holds_string(t))
SAMPLE_FIELDS = ALERT_FIELDS | CONTRACT_FIELDS | STRING_FIELDS


def projected_schema() -> dict[str, Any]:
    """The current GpuSample schema with only :data:`SAMPLE_FIELDS`."""
    raw = copy.deepcopy(_CURRENT.raw)
    raw["fields"] = [f for f in raw["fields"] if f["name"] in SAMPLE_FIELDS]
    return raw


class AlertsDecoder:
    """Codec-shaped for the consume loop; see module doc."""

    def __init__(self, codec: AvroCodec) -> None:
        self.codec = codec
        self._fast = SampleDecoder(codec, projected_schema()).fast  # writer fingerprint -> decoder

    def decode(self, payload: bytes | None) -> Decoded:
        if payload and payload[:2] == SINGLE_OBJECT_MAGIC:
            fn = self._fast.get(payload[2:10])
            if fn is not None:
                try:
                    return Decoded("GpuSample", fn(payload, 10), "single-object")
                except CORRUPT:
                    pass  # the codec decodes it or raises the DecodeError with its own reason
        return self.codec.decode(payload)
