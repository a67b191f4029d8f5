"""Profiling group (default every 1 s): GPU Performance Monitoring (GPM), Hopper or newer.

GPM metrics are rates between two samples taken more than 100 ms apart. Instead of sleeping,
the collector keeps the previous sample of each device between ticks: every tick takes one new
sample and computes the metrics over (previous, new), then the new one becomes the previous.
The first tick after start therefore has no profiling values (null). Two sample buffers per
device are allocated once and reused; ``release`` frees them.

GPM metric -> field (percent -> ratio /100; MiB/s -> bytes/s x 1048576):

====================================  ==========================
``NVML_GPM_METRIC_GRAPHICS_UTIL``     gr_engine_active_ratio
``NVML_GPM_METRIC_SM_UTIL``           sm_active_ratio
``NVML_GPM_METRIC_SM_OCCUPANCY``      sm_occupancy_ratio
``NVML_GPM_METRIC_ANY_TENSOR_UTIL``   tensor_active_ratio
``NVML_GPM_METRIC_DRAM_BW_UTIL``      dram_active_ratio
``NVML_GPM_METRIC_FP64/32/16_UTIL``   fp64/fp32/fp16_active_ratio
``NVML_GPM_METRIC_PCIE_TX/RX_PER_SEC``   pcie_tx/rx_bytes_per_s
``NVML_GPM_METRIC_NVLINK_TOTAL_TX/RX_PER_SEC``  nvlink_tx/rx_bytes_per_s
====================================  ==========================

A MIG slice is sampled per GPU instance with ``nvmlGpmMigSampleGet(parent, gpu_instance_id)``.
A GPU whose ``nvmlGpmQueryDeviceSupport`` says no (pre-Hopper) is learned once: GPM is never
called for it again and the fields stay null (the node agent may fill them from dcgm-exporter).
Values from GPM are marked ``profiling_source = "gpm"``. Each metric carries its own return code; a
metric NotSupported on a device (e.g. PCIe for a MIG instance) is learned and not asked again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from gpupipe_producer.nvml import convert
from gpupipe_producer.nvml.base import DeviceContext

MIN_SAMPLE_GAP_S = 0.1  # NVML: samples must be more than 100 ms apart

_MIB = convert.mib_per_s_to_bytes_per_s
# (constant name, default id, field, converter)
_METRICS: tuple[tuple[str, int, str, Callable[[Any], Any]], ...] = (
    ("NVML_GPM_METRIC_GRAPHICS_UTIL", 1, "gr_engine_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_SM_UTIL", 2, "sm_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", 3, "sm_occupancy_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5, "tensor_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", 10, "dram_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_FP64_UTIL", 11, "fp64_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_FP32_UTIL", 12, "fp32_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_FP16_UTIL", 13, "fp16_active_ratio", convert.gpm_pct_to_ratio),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", 20, "pcie_tx_bytes_per_s", _MIB),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", 21, "pcie_rx_bytes_per_s", _MIB),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", 61, "nvlink_tx_bytes_per_s", _MIB),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", 60, "nvlink_rx_bytes_per_s", _MIB),
)


class _GpmState:
    __slots__ = ("last", "prev", "prev_time", "spare")

    def __init__(self) -> None:
        self.prev: Any = None  # the sample taken at the previous tick
        self.prev_time = 0.0
        self.spare: Any = None  # the buffer the next sample goes into
        self.last: dict[str, Any] = {}


class GpmCollector:
    name = "profiling"
    fields = (*dict.fromkeys(m[2] for m in _METRICS), "pcie_window_ms", "profiling_source")

    def __init__(self, nvml: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml
        self._clock = clock
        ids = [int(getattr(nvml, const, default)) for const, default, _, _ in _METRICS]
        self._metrics = tuple(
            (mid, f"gpm_metric:{mid}", field, conv)
            for mid, (_, _, field, conv) in zip(ids, _METRICS, strict=True)
        )
        self._version = getattr(nvml, "NVML_GPM_METRICS_GET_VERSION", 1)
        self._mg: Any = None  # one c_nvmlGpmMetricsGet_t, reused (the poll is single-threaded)

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        if not self._supported(ctx):
            return {}
        st: _GpmState | None = ctx.state.get("gpm")
        if st is None:
            st = ctx.state["gpm"] = _GpmState()
        now = self._clock()
        if st.prev is not None and now - st.prev_time < MIN_SAMPLE_GAP_S:
            return dict(st.last)  # too soon for a new sample: repeat the last rates
        if st.spare is None:
            st.spare = ctx.call("gpm_alloc", "nvmlGpmSampleAlloc")
            if st.spare is None:
                return {}
        sample = st.spare
        if ctx.is_mig:
            assert ctx.parent is not None
            got = ctx.call(
                "gpm_sample", "nvmlGpmMigSampleGet", ctx.parent.handle, ctx.gpu_instance_id, sample
            )
        else:
            got = ctx.call("gpm_sample", "nvmlGpmSampleGet", ctx.handle, sample)
        if got is None:
            if "gpm_sample" in ctx.unsupported:
                self.release(ctx)
            return {}
        prev, prev_time = st.prev, st.prev_time
        st.prev, st.prev_time, st.spare = sample, now, prev
        if prev is None:
            return {}  # first sample: rates need a second one
        st.last = out = self._rates(ctx, prev, sample)
        if out:
            out["profiling_source"] = "gpm"
        if out.get("pcie_tx_bytes_per_s") is not None or out.get("pcie_rx_bytes_per_s") is not None:
            out["pcie_window_ms"] = max(1, round((now - prev_time) * 1000))
        return dict(out)

    def _supported(self, ctx: DeviceContext) -> bool:
        if "gpm" in ctx.unsupported or "gpm_sample" in ctx.unsupported:
            return False
        if ctx.is_mig and ctx.parent is not None:
            # Derived from the parent at collect time, not copied at creation: slices made when MIG
            # was enabled after start would otherwise keep the parent's "unknown yet" forever.
            parent = ctx.parent
            return self._supported(parent) if parent.gpm_supported is None else bool(parent.gpm_supported)
        if ctx.gpm_supported is None:
            support = ctx.call("gpm", "nvmlGpmQueryDeviceSupport", ctx.handle)
            if support is not None:
                ctx.gpm_supported = bool(getattr(support, "isSupportedDevice", 0))
                if not ctx.gpm_supported:
                    ctx.learn("gpm", "nvmlGpmQueryDeviceSupport: isSupportedDevice=0 (pre-Hopper)")
        return bool(ctx.gpm_supported)

    def _rates(self, ctx: DeviceContext, sample1: Any, sample2: Any) -> dict[str, Any]:
        wanted = [m for m in self._metrics if m[1] not in ctx.unsupported]
        if not wanted:
            return {}
        mg = self._mg
        if mg is None:
            mg = self._mg = self._nvml.c_nvmlGpmMetricsGet_t()
        mg.version = self._version
        mg.numMetrics = len(wanted)
        mg.sample1 = sample1
        mg.sample2 = sample2
        for i, (metric_id, _, _, _) in enumerate(wanted):
            mg.metrics[i].metricId = metric_id
        if ctx.call("gpm_metrics", "nvmlGpmMetricsGet", mg) is None:
            return {}
        out: dict[str, Any] = {}
        for i, (_, key, field, conv) in enumerate(wanted):
            m = mg.metrics[i]
            if ctx.check(int(m.nvmlReturn), key):
                ctx.put(out, field, conv, m.value)
        return out

    def release(self, ctx: DeviceContext) -> None:
        st: _GpmState | None = ctx.state.pop("gpm", None)
        if st is None:
            return
        for sample in (st.prev, st.spare):
            if sample is not None:
                with contextlib.suppress(Exception):  # freeing at shutdown must never raise
                    self._nvml.nvmlGpmSampleFree(sample)
