"""Crafted GpuSample / XidEvent records with known values, and readers of OTLP messages (the OTLP
exporter's unit and integration tests)."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

from tests.lake_records import fill

T_MS = 1_790_000_000_123
UUID = "GPU-11111111-2222-3333-4444-555555555555"
MIG_UUID = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def alloc(ns: str, pod: str, **over: Any) -> dict[str, Any]:
    entry = {
        "namespace": ns,
        "pod": pod,
        "container": "main",
        "resource_name": "nvidia.com/gpu",
        "replica": None,
        "owner_kind": None,
        "owner_name": None,
        "labels": {},
        "priority_class": None,
        "metadata_status": None,
        "hpc_job": None,
    }
    return {**entry, **over}


def sample(**over: Any) -> dict[str, Any]:
    rec = fill(
        "GpuSample",
        timestamp_ms=T_MS,
        hostname="node-a",
        gpu_index=3,
        uuid=UUID,
        pci_bus_id="00000000:3B:00.0",
        model_name="NVIDIA H200",
        driver_version="570.124.06",
        serial="1650924060000",
        vbios_version="96.00.AF.00.01",
        gpu_util_ratio=0.75,
        enc_util_ratio=0.0,
        dec_util_ratio=0.125,
        fb_used_bytes=40 * 2**30,
        fb_total_bytes=80 * 2**30,
        power_w=512.5,
        total_energy_mj=123_456_789,
        gpu_temp_c=61.0,
        memory_temp_c=70.0,
        pcie_rx_bytes_per_s=2_000_000.0,
        pcie_tx_bytes_per_s=1_000_000.0,
        pcie_window_ms=1000,
        ecc_sbe_volatile_total=7,
        ecc_dbe_volatile_total=0,
        sm_active_ratio=0.5,
        nvlink_tx_bytes_per_s=3.0e9,
        nvlink_links=18,
        nvlink_links_up=17,
        nvlink_replay_errors_total=4,
        allocations=[alloc("team-a", "train-0", owner_kind="Job", owner_name="train", labels={"team": "a"})],
    )
    rec.update(over)
    return rec


def value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value"))


def attrs(kvs: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


def points(req: Any) -> list[tuple[dict[str, Any], Metric, dict[str, Any], Any]]:
    """(resource attributes, metric, point attributes, point) for every data point of a request."""
    out = []
    for rm in req.resource_metrics:
        res = attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.gauge.data_points if m.HasField("gauge") else m.sum.data_points:
                    out.append((res, m, attrs(dp.attributes), dp))
    return out


def num(dp: Any) -> int | float:
    return dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double


def xid(**over: Any) -> dict[str, Any]:
    rec = fill(
        "XidEvent",
        event_id="ev-1",
        timestamp_ms=T_MS,
        hostname="node-a",
        kind="xid",
        xid=79,
        pci_bus_id="0000:3b:00",
        gpu_index=3,
        uuid=UUID,
        model_name="NVIDIA H200",
        driver_version="570.124.06",
        pid=4242,
        process_name="python3",
        message="GPU has fallen off the bus.",
        source="kmsg",
        allocations=[alloc("team-a", "train-0")],
        boot_id="b0",
    )
    rec.update(over)
    return rec
