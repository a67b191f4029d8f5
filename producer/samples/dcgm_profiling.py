"""DCGM profiling ratios from a dcgm-exporter scrape, put on GpuSamples where NVML's GPM gave none (pure).

``parse_scrape`` reads the Prometheus text of a dcgm-exporter ``/metrics`` page into
:data:`Readings`: per (GPU UUID, GPU instance id or None) the ``DCGM_FI_PROF_*`` values under their
GpuSample field names. Both the names up to 4.8 and the renamed ones of 4.9/4.10 are read; a
series repeated per pod (the same GPU) keeps its first value. ``fill_samples`` copies them onto the
samples of a poll that carry no GPM value (``profiling_source`` null) and marks those
``profiling_source = "dcgm-exporter"``. PCIe is taken only where NVML measured none (NVML's own
reading stays, with its window).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

SOURCE = "dcgm-exporter"

#: dcgm-exporter metric name -> GpuSample field (values are ratios 0..1 or bytes per second).
FIELD_OF_METRIC: dict[str, str] = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gr_engine_active_ratio",
    "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO": "gr_engine_active_ratio",
    "DCGM_FI_PROF_SM_ACTIVE": "sm_active_ratio",
    "DCGM_FI_PROF_SM_UTIL_RATIO": "sm_active_ratio",
    "DCGM_FI_PROF_SM_OCCUPANCY": "sm_occupancy_ratio",
    "DCGM_FI_PROF_SM_OCCUPANCY_RATIO": "sm_occupancy_ratio",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "tensor_active_ratio",
    "DCGM_FI_PROF_TENSOR_UTIL_RATIO": "tensor_active_ratio",
    "DCGM_FI_PROF_DRAM_ACTIVE": "dram_active_ratio",
    "DCGM_FI_PROF_DRAM_UTIL_RATIO": "dram_active_ratio",
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": "fp64_active_ratio",
    "DCGM_FI_PROF_FP64_UTIL_RATIO": "fp64_active_ratio",
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": "fp32_active_ratio",
    "DCGM_FI_PROF_FP32_UTIL_RATIO": "fp32_active_ratio",
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": "fp16_active_ratio",
    "DCGM_FI_PROF_FP16_UTIL_RATIO": "fp16_active_ratio",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "pcie_tx_bytes_per_s",
    "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND": "pcie_tx_bytes_per_s",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "pcie_rx_bytes_per_s",
    "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND": "pcie_rx_bytes_per_s",
    "DCGM_FI_PROF_NVLINK_TX_BYTES": "nvlink_tx_bytes_per_s",
    "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND": "nvlink_tx_bytes_per_s",
    "DCGM_FI_PROF_NVLINK_RX_BYTES": "nvlink_rx_bytes_per_s",
    "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND": "nvlink_rx_bytes_per_s",
}
PROFILING_FIELDS = tuple(dict.fromkeys(FIELD_OF_METRIC.values()))
_PCIE_FIELDS = frozenset({"pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"})

#: (GPU UUID, GPU instance id; None for the whole GPU) -> {GpuSample field: value}
Readings = dict[tuple[str, int | None], dict[str, float]]


class ScrapeError(ValueError):
    """The text is not a Prometheus exposition (or holds no dcgm-exporter series)."""


def parse_scrape(text: str) -> Readings:
    """The profiling readings of one scrape; :class:`ScrapeError` when the text does not parse."""
    out: Readings = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, and others on odd input
        raise ScrapeError(f"not Prometheus text: {exc}") from exc
    for fam in families:
        for s in fam.samples:
            field = FIELD_OF_METRIC.get(s.name)
            if field is None:
                continue
            key = _key(s.labels)
            value = _value(field, s.value)
            if key is None or value is None:
                continue
            out.setdefault(key, {}).setdefault(field, value)
    return out


def _key(labels: Mapping[str, str]) -> tuple[str, int | None] | None:
    uuid = labels.get("UUID") or labels.get("uuid")
    if not uuid:
        return None
    gi = labels.get("GPU_I_ID")
    if gi in (None, ""):
        return uuid, None
    try:
        return uuid, int(gi)
    except ValueError:
        return None


def _value(field: str, raw: Any) -> float | None:
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v) or v < 0:
        return None
    if field.endswith("_ratio") and v > 1:
        return None  # DCGM's blank/sentinel values are huge integers, never a ratio
    return v


def fill_samples(samples: Iterable[dict[str, Any]], readings: Readings) -> int:
    """Put the readings on the samples without GPM values; returns how many samples got some."""
    filled = 0
    for s in samples:
        if s.get("profiling_source") is not None or s.get("gpu_lost"):
            continue
        mig = s.get("mig")
        key = (s.get("uuid") or "", None if not mig else mig.get("gpu_instance_id"))
        got = readings.get(key)
        if not got:
            continue
        for field, value in got.items():
            if field in _PCIE_FIELDS and s.get(field) is not None:
                continue  # NVML measured PCIe itself: its value and window stay together
            s[field] = value
        s["profiling_source"] = SOURCE
        filled += 1
    return filled
