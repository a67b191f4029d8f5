"""GpuSample and XidEvent records as OTLP messages: pure, no clock, no I/O.

Names, units and attributes follow the OpenTelemetry hardware semantic conventions (``hw.*``); what
they have no name for (MIG slices, NVLink, time-sliced replicas, XID classification) is carried under
``gpupipe.*``. docs/otel.md is the table of this module; tests check every name against the
conventions' own YAML (tests/fixtures/otel/).

Resources are per pod: one ``Resource`` per (node, allocation), so a backend can ask "what did this
pod's GPU do" without a join. An unallocated GPU's readings go under the node's resource. A GPU
shared by several pods (time slicing) appears under each holder's resource, with
``gpupipe.gpu.shared_by`` saying how many; a sum over pods must count each ``hw.id`` once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs, SeverityNumber
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from gpupipe_schemas.meaning import gpu_key
from gpupipe_schemas.xid_catalog import CATALOG_VERSION, Severity, XidInfo, lookup

Kind = Literal["gauge", "updowncounter", "counter", "delta_counter"]
Attr = str | int | float | bool
Attrs = tuple[tuple[str, Attr], ...]

#: The semantic-conventions release the names below were checked against (tests/fixtures/otel/).
SEMCONV_VERSION = "1.44.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
SCOPE = InstrumentationScope(name="gpupipe")
#: ``hw.vendor`` per the records' ``vendor`` (a maker not listed here is passed on as written).
VENDORS = {"nvidia": "NVIDIA", "amd": "AMD", "intel": "Intel"}


def hw_vendor(rec: dict[str, Any]) -> str:
    v = rec.get("vendor") or "nvidia"
    return VENDORS.get(v, v)


@dataclass(frozen=True, slots=True)
class Instrument:
    name: str
    unit: str
    kind: Kind  # counter: cumulative monotonic Sum; delta_counter: a delta Sum; updowncounter: not monotonic
    description: str


_INSTRUMENTS = (
    Instrument("hw.gpu.utilization", "1", "gauge", "Fraction of time spent in a specific task."),
    Instrument("hw.gpu.memory.usage", "By", "updowncounter", "GPU memory used."),
    Instrument("hw.gpu.memory.limit", "By", "updowncounter", "Size of the GPU memory."),
    Instrument("hw.gpu.memory.utilization", "1", "gauge", "Fraction of GPU memory used."),
    Instrument("hw.gpu.io", "By", "delta_counter", "Received and transmitted bytes by the GPU (PCIe)."),
    Instrument("hw.power", "W", "gauge", "Instantaneous power consumed by the GPU."),
    Instrument("hw.energy", "J", "counter", "Energy consumed by the GPU since the driver loaded."),
    Instrument("hw.temperature", "Cel", "gauge", "Temperature in degrees Celsius."),
    Instrument("hw.errors", "{error}", "counter", "ECC errors of the GPU since the driver loaded."),
    Instrument("hw.status", "1", "updowncounter", "Operational status: 1 for the state the GPU is in."),
    Instrument("gpupipe.gpu.sm.active", "1", "gauge", "Share of SM cycles with at least one warp assigned."),
    Instrument("gpupipe.gpu.tensor.active", "1", "gauge", "Share of cycles the tensor pipes were active."),
    Instrument("gpupipe.gpu.nvlink.throughput", "By/s", "gauge", "NVLink throughput over all links."),
    Instrument("gpupipe.gpu.nvlink.errors", "{error}", "counter", "NVLink errors over all links."),
    Instrument("gpupipe.gpu.nvlink.links", "{link}", "updowncounter", "NVLink links by state."),
)
INSTRUMENTS: dict[str, Instrument] = {i.name: i for i in _INSTRUMENTS}

#: Our XID severity -> OTLP severity number (the log data model's ranges: critical is a fatal error
#: of the GPU, a warning wants a ticket, info is a record).
SEVERITY_NUMBERS = {
    Severity.CRITICAL: SeverityNumber.SEVERITY_NUMBER_FATAL,
    Severity.WARNING: SeverityNumber.SEVERITY_NUMBER_WARN,
    Severity.INFO: SeverityNumber.SEVERITY_NUMBER_INFO,
}

# NVML notice events without an XID code: the alerts service's default reading of each.
_NOTICE_SEVERITY = {
    "recovery_action": Severity.WARNING,
    "gpu_unavailable": Severity.CRITICAL,
    "driver_loaded": Severity.INFO,
    "unknown": Severity.WARNING,
}

# Owner kinds the Kubernetes resource conventions name (k8s.<kind>.name); others go to gpupipe.k8s.owner.*.
_OWNER_ATTRS = {
    "Deployment": "k8s.deployment.name",
    "StatefulSet": "k8s.statefulset.name",
    "DaemonSet": "k8s.daemonset.name",
    "ReplicaSet": "k8s.replicaset.name",
    "Job": "k8s.job.name",
    "CronJob": "k8s.cronjob.name",
}


def _any(v: Attr) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=v)


def key_values(attrs: Iterable[tuple[str, Attr]]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_any(v)) for k, v in attrs]


def _put(out: list[tuple[str, Attr]], key: str, value: Attr | None) -> None:
    if value is not None and value != "":
        out.append((key, value))


def resource_attrs(rec: dict[str, Any]) -> list[Attrs]:
    """One resource per allocation of the record (the node's alone when none), as attribute tuples."""
    host = rec["hostname"]
    node: list[tuple[str, Attr]] = [("host.name", host), ("k8s.node.name", host)]
    allocs = rec.get("allocations") or []
    if not allocs:
        state = "unallocated" if rec.get("allocations_known", True) else "unknown"
        return [(*node, ("gpupipe.k8s.attribution", state))]
    stale = rec.get("allocations_stale", False)
    out = []
    for a in allocs:
        attrs = list(node)
        attrs += [
            ("k8s.namespace.name", a["namespace"]),
            ("k8s.pod.name", a["pod"]),
            ("k8s.container.name", a["container"]),
        ]
        kind, name = a.get("owner_kind"), a.get("owner_name")
        if kind and name:
            if kind in _OWNER_ATTRS:
                attrs.append((_OWNER_ATTRS[kind], name))
            else:
                attrs += [("gpupipe.k8s.owner.kind", kind), ("gpupipe.k8s.owner.name", name)]
        for label, value in sorted((a.get("labels") or {}).items()):
            attrs.append((f"k8s.pod.label.{label}", value))
        _put(attrs, "gpupipe.k8s.resource_name", a.get("resource_name"))
        _put(attrs, "gpupipe.gpu.replica", a.get("replica"))
        _put(attrs, "gpupipe.hpc.job", a.get("hpc_job"))
        if len(allocs) > 1:
            attrs.append(("gpupipe.gpu.shared_by", len(allocs)))
        attrs.append(("gpupipe.k8s.attribution", "stale" if stale else "allocated"))
        out.append(tuple(attrs))
    return out


def _hw_name(rec: dict[str, Any]) -> str:
    mig = rec.get("mig")
    base = f"gpu{rec['gpu_index']}"
    return f"{base} mig {mig['profile']} gi{mig['gpu_instance_id']}" if mig else base


def _gpupipe_gpu_attrs(rec: dict[str, Any]) -> list[tuple[str, Attr]]:
    out: list[tuple[str, Attr]] = [
        ("gpupipe.gpu.index", rec["gpu_index"]),
        ("gpupipe.gpu.pci_bus_id", rec["pci_bus_id"]),
    ]
    mig = rec.get("mig")
    if mig:
        out += [
            ("gpupipe.mig.profile", mig["profile"]),
            ("gpupipe.mig.gpu_instance_id", mig["gpu_instance_id"]),
            ("gpupipe.mig.compute_instance_id", mig["compute_instance_id"]),
            ("gpupipe.mig.slice_fraction", float(mig["slice_fraction"])),
        ]
    return out


@dataclass(frozen=True, slots=True)
class _GpuAttrs:
    common: Attrs  # hw.id, hw.name, hw.parent + gpupipe.gpu.* / gpupipe.mig.*
    gpu: Attrs  # common + the GPU's descriptive attributes (metric_attributes.hw.gpu)
    typed: Attrs  # common + hw.type=gpu (hw.power, hw.energy)
    gpu_typed: Attrs  # gpu + hw.type=gpu (the GPU refinements of hw.errors, hw.status)


def _gpu_attrs(rec: dict[str, Any]) -> _GpuAttrs:
    common: list[tuple[str, Attr]] = [("hw.id", gpu_key(rec)), ("hw.name", _hw_name(rec))]
    if rec.get("mig"):
        common.append(("hw.parent", rec["uuid"]))
    ext = _gpupipe_gpu_attrs(rec)
    desc: list[tuple[str, Attr]] = [("hw.vendor", hw_vendor(rec)), ("hw.model", rec["model_name"])]
    _put(desc, "hw.driver_version", rec.get("driver_version"))
    _put(desc, "hw.serial_number", rec.get("serial"))
    _put(desc, "hw.firmware_version", rec.get("vbios_version"))
    return _GpuAttrs(
        common=(*common, *ext),
        gpu=(*common, *desc, *ext),
        typed=(*common, ("hw.type", "gpu"), *ext),
        gpu_typed=(*common, *desc, ("hw.type", "gpu"), *ext),
    )


Point = tuple[str, Attrs, int | float, int]  # metric name, attributes, value, start time (ns; 0: none)

# (metric, which attribute set, extra attribute or None, field, float or int): one point per non-null field.
_FIELDS: tuple[tuple[str, str, tuple[str, str] | None, str, type], ...] = (
    ("hw.gpu.utilization", "gpu", ("hw.gpu.task", "general"), "gpu_util_ratio", float),
    ("hw.gpu.utilization", "gpu", ("hw.gpu.task", "encoder"), "enc_util_ratio", float),
    ("hw.gpu.utilization", "gpu", ("hw.gpu.task", "decoder"), "dec_util_ratio", float),
    ("hw.gpu.memory.usage", "gpu", None, "fb_used_bytes", int),
    ("hw.gpu.memory.limit", "gpu", None, "fb_total_bytes", int),
    ("hw.power", "typed", None, "power_w", float),
    ("hw.errors", "gpu_typed", ("error.type", "corrected"), "ecc_sbe_volatile_total", int),
    ("hw.errors", "gpu_typed", ("error.type", "uncorrected"), "ecc_dbe_volatile_total", int),
    ("gpupipe.gpu.sm.active", "gpu", None, "sm_active_ratio", float),
    ("gpupipe.gpu.tensor.active", "gpu", None, "tensor_active_ratio", float),
    (
        "gpupipe.gpu.nvlink.throughput",
        "gpu",
        ("network.io.direction", "receive"),
        "nvlink_rx_bytes_per_s",
        float,
    ),
    (
        "gpupipe.gpu.nvlink.throughput",
        "gpu",
        ("network.io.direction", "transmit"),
        "nvlink_tx_bytes_per_s",
        float,
    ),
    ("gpupipe.gpu.nvlink.errors", "gpu", ("error.type", "crc_flit"), "nvlink_crc_flit_errors_total", int),
    ("gpupipe.gpu.nvlink.errors", "gpu", ("error.type", "crc_data"), "nvlink_crc_data_errors_total", int),
    ("gpupipe.gpu.nvlink.errors", "gpu", ("error.type", "replay"), "nvlink_replay_errors_total", int),
    ("gpupipe.gpu.nvlink.errors", "gpu", ("error.type", "recovery"), "nvlink_recovery_errors_total", int),
)
_PCIE = (("receive", "pcie_rx_bytes_per_s"), ("transmit", "pcie_tx_bytes_per_s"))
_TEMPERATURES = (("gpu", "gpu_temp_c"), ("memory", "memory_temp_c"))


def sample_points(rec: dict[str, Any]) -> list[Point]:
    """The data points of one GpuSample (all at its timestamp); a null field gives no point."""
    g = _gpu_attrs(rec)
    sets = {"gpu": g.gpu, "typed": g.typed, "gpu_typed": g.gpu_typed}
    lost = bool(rec.get("gpu_lost"))
    pts: list[Point] = [
        ("hw.status", (*g.gpu_typed, ("hw.state", "ok")), 0 if lost else 1, 0),
        ("hw.status", (*g.gpu_typed, ("hw.state", "failed")), 1 if lost else 0, 0),
    ]
    for metric, which, extra, field, cast in _FIELDS:
        value = rec.get(field)
        if value is not None:
            attrs = sets[which] if extra is None else (*sets[which], extra)
            pts.append((metric, attrs, cast(value), 0))
    used, total = rec.get("fb_used_bytes"), rec.get("fb_total_bytes")
    if used is not None and total:
        pts.append(("hw.gpu.memory.utilization", g.gpu, used / total, 0))
    # PCIe rates are averages over pcie_window_ms: the bytes of that window, as a delta over it.
    window = rec.get("pcie_window_ms")
    if window:
        start = (rec["timestamp_ms"] - window) * 1_000_000
        for direction, field in _PCIE:
            rate = rec.get(field)
            if rate is not None:
                attrs = (*g.gpu, ("network.io.direction", direction))
                pts.append(("hw.gpu.io", attrs, round(rate * window / 1000), start))
    energy = rec.get("total_energy_mj")
    if energy is not None:
        pts.append(("hw.energy", g.typed, energy / 1000, 0))
    for location, field in _TEMPERATURES:
        value = rec.get(field)
        if value is not None:
            sensor = (
                ("hw.id", f"{gpu_key(rec)}/temperature/{location}"),
                ("hw.name", f"{_hw_name(rec)} {location} temperature"),
                ("hw.parent", gpu_key(rec)),
                ("hw.sensor_location", location),
                *_gpupipe_gpu_attrs(rec),
            )
            pts.append(("hw.temperature", sensor, float(value), 0))
    links, up = rec.get("nvlink_links"), rec.get("nvlink_links_up")
    if links is not None and up is not None:
        pts.append(("gpupipe.gpu.nvlink.links", (*g.gpu, ("gpupipe.nvlink.state", "up")), up, 0))
        pts.append(
            ("gpupipe.gpu.nvlink.links", (*g.gpu, ("gpupipe.nvlink.state", "down")), max(links - up, 0), 0)
        )
    return pts


# -- the metrics wire encoding -------------------------------------------------------------------
# Metrics are many (about 17 points of 7 attributes per sample), and building protobuf message objects
# costs about 10 us per attribute; so the request is written in protobuf's wire format directly, each
# distinct attribute set encoded once (a GPU's attributes repeat every sample). The field numbers
# are those of opentelemetry/proto/metrics/v1/metrics.proto; a unit test parses the bytes with the
# generated classes and compares them field by field.


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 as protobuf writes it: ten bytes of two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = tuple(_varint(i) for i in range(1 << 14))  # lengths and tags: most are small
_LD_TAGS = tuple(_varint(f << 3 | 2) for f in range(16))


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message)."""
    n = len(payload)
    return _LD_TAGS[field] + (_SMALL[n] if n < 16384 else _varint(n)) + payload


def _any_bytes(v: Attr) -> bytes:
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")  # bool_value = 2
    if isinstance(v, int):
        return b"\x18" + _varint(v)  # int_value = 3
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)  # double_value = 4
    return _ld(1, v.encode())  # string_value = 1


def _kv_bytes(key: str, v: Attr) -> bytes:
    return _ld(1, key.encode()) + _ld(2, _any_bytes(v))


_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_SFIXED64 = struct.Struct("<q")
_CACHE_MAX = 200_000  # distinct attribute sets kept encoded: a few per GPU, so ~10k GPUs


class _Encoded(dict[Attrs, bytes]):
    """Attribute sets encoded once, as repeated ``field``; cleared when it outgrows ``_CACHE_MAX``."""

    def __init__(self, field: int) -> None:
        super().__init__()
        self.field = field

    def __missing__(self, attrs: Attrs) -> bytes:
        if len(self) >= _CACHE_MAX:
            self.clear()
        out = self[attrs] = b"".join(_ld(self.field, _kv_bytes(k, v)) for k, v in attrs)
        return out


_POINT_ATTRS = _Encoded(7)  # NumberDataPoint.attributes
_RESOURCE_ATTRS = _Encoded(1)  # Resource.attributes


def _data_point(attrs: Attrs, value: int | float, ts: int, start: int) -> bytes:
    out = _POINT_ATTRS[attrs]
    if start:
        out += b"\x11" + _FIXED64.pack(start)  # start_time_unix_nano = 2
    out += b"\x19" + _FIXED64.pack(ts)  # time_unix_nano = 3
    if isinstance(value, int):
        return out + b"\x31" + _SFIXED64.pack(value)  # as_int = 6
    return out + b"\x21" + _DOUBLE.pack(value)  # as_double = 4


def _metric_head(ins: Instrument) -> bytes:
    return _ld(1, ins.name.encode()) + _ld(2, ins.description.encode()) + _ld(3, ins.unit.encode())


_HEADS = {name: _metric_head(ins) for name, ins in INSTRUMENTS.items()}
_SUM_TAIL = {
    "updowncounter": b"\x10" + _varint(AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE),
    "counter": b"\x10" + _varint(AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE) + b"\x18\x01",
    "delta_counter": b"\x10" + _varint(AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA) + b"\x18\x01",
}


def _metric(name: str, points: list[bytes]) -> bytes:
    ins = INSTRUMENTS[name]
    body = b"".join(_ld(1, dp) for dp in points)  # Gauge/Sum.data_points = 1
    if ins.kind == "gauge":
        return _HEADS[name] + _ld(5, body)  # Metric.gauge = 5
    return _HEADS[name] + _ld(7, body + _SUM_TAIL[ins.kind])  # Metric.sum = 7


_SCOPE = _ld(1, SCOPE.SerializeToString())
_SCHEMA = _ld(3, SCHEMA_URL.encode())


@dataclass(frozen=True, slots=True)
class Encoded:
    """An export request in wire format, with how many items (data points, log records) it holds."""

    payload: bytes
    items: int


def encode_metrics(samples: Sequence[dict[str, Any]]) -> Encoded:
    """One ExportMetricsServiceRequest for these samples: a ResourceMetrics per resource, a Metric
    per name in it, the points in sample order."""
    by_resource: dict[Attrs, dict[str, list[bytes]]] = {}
    n = 0
    for rec in samples:
        ts = rec["timestamp_ms"] * 1_000_000
        points = [
            (name, _data_point(attrs, value, ts, start)) for name, attrs, value, start in sample_points(rec)
        ]
        for res in resource_attrs(rec):
            metrics = by_resource.setdefault(res, {})
            for name, dp in points:
                metrics.setdefault(name, []).append(dp)
            n += len(points)
    out = []
    for res, metrics in by_resource.items():
        scope = _SCOPE + b"".join(_ld(2, _metric(name, pts)) for name, pts in metrics.items()) + _SCHEMA
        rm = _ld(1, _RESOURCE_ATTRS[res]) + _ld(2, scope) + _SCHEMA
        out.append(_ld(1, rm))
    return Encoded(b"".join(out), n)


def metrics_request(samples: Sequence[dict[str, Any]]) -> ExportMetricsServiceRequest:
    """:func:`encode_metrics` as a message (tests, and whoever wants to look at one)."""
    return ExportMetricsServiceRequest.FromString(encode_metrics(samples).payload)


def xid_info(rec: dict[str, Any]) -> XidInfo | None:
    """The catalog row of an event: its own code, Xid 79 for a GPU gone, None for an NVML notice."""
    kind, code = rec["kind"], rec.get("xid")
    if kind in ("xid", "sxid") and code is not None:
        return lookup(code, kind)
    if kind in ("fallen_off_bus", "gpu_lost"):
        return lookup(79)
    return None


def xid_severity(rec: dict[str, Any]) -> Severity:
    info = xid_info(rec)
    return info.severity if info is not None else _NOTICE_SEVERITY.get(rec["kind"], Severity.WARNING)


def xid_attrs(rec: dict[str, Any]) -> Attrs:
    info = xid_info(rec)
    out: list[tuple[str, Attr]] = [("hw.type", "gpu"), ("hw.vendor", hw_vendor(rec))]
    gpu = rec.get("mig_uuid") or rec.get("uuid")
    _put(out, "hw.id", gpu)
    if rec.get("mig_uuid") and rec.get("uuid"):
        out.append(("hw.parent", rec["uuid"]))
    _put(out, "hw.model", rec.get("model_name"))
    _put(out, "hw.driver_version", rec.get("driver_version"))
    _put(out, "gpupipe.gpu.index", rec.get("gpu_index"))
    _put(out, "gpupipe.gpu.pci_bus_id", rec["pci_bus_id"])
    _put(out, "gpupipe.mig.gpu_instance_id", rec.get("gpu_instance_id"))
    _put(out, "gpupipe.mig.compute_instance_id", rec.get("compute_instance_id"))
    _put(out, "process.pid", rec.get("pid"))
    _put(out, "process.executable.name", rec.get("process_name"))
    out += [
        ("gpupipe.xid.event_id", rec["event_id"]),
        ("gpupipe.xid.kind", rec["kind"]),
        ("gpupipe.xid.source", rec["source"]),
    ]
    _put(out, "gpupipe.xid.code", rec.get("xid"))
    if info is not None:
        out += [
            ("gpupipe.xid.name", info.name),
            ("gpupipe.xid.cause", str(info.cause_class)),
            ("gpupipe.xid.action", str(info.bucket)),
        ]
        if info.nvidia_action is not None:
            out.append(("gpupipe.xid.nvidia_action", str(info.nvidia_action)))
        out += [
            ("gpupipe.xid.drain_node", info.drain_node),
            ("gpupipe.xid.runbook", info.runbook),
            ("gpupipe.xid.known", info.known),
            ("gpupipe.xid.catalog_version", CATALOG_VERSION),
        ]
    _put(out, "gpupipe.node.boot_id", rec.get("boot_id"))
    return tuple(out)


def xid_body(rec: dict[str, Any]) -> str:
    """The kernel message; an event only NVML saw has none, so the catalog's description stands in."""
    if rec.get("message"):
        return str(rec["message"])
    info = xid_info(rec)
    label = "SXid" if rec["kind"] == "sxid" else "Xid"
    if info is not None and rec.get("xid") is not None:
        return f"{label} {rec['xid']}: {info.description}"
    return rec["kind"].replace("_", " ")


def log_record(rec: dict[str, Any]) -> LogRecord:
    ts = rec["timestamp_ms"] * 1_000_000
    severity = xid_severity(rec)
    return LogRecord(
        time_unix_nano=ts,
        observed_time_unix_nano=ts,
        severity_number=SEVERITY_NUMBERS[severity],
        severity_text=str(severity).upper(),
        body=AnyValue(string_value=xid_body(rec)),
        attributes=key_values(xid_attrs(rec)),
        event_name="gpupipe.xid",
    )


def encode_logs(events: Sequence[dict[str, Any]]) -> Encoded:
    req = logs_request(events)
    return Encoded(
        req.SerializeToString(), sum(len(rl.scope_logs[0].log_records) for rl in req.resource_logs)
    )


def logs_request(events: Sequence[dict[str, Any]]) -> ExportLogsServiceRequest:
    """One export request for these XID events: a log record under each holder pod's resource."""
    by_resource: dict[Attrs, list[LogRecord]] = {}
    for rec in events:
        lr = log_record(rec)
        for res in resource_attrs(rec):
            by_resource.setdefault(res, []).append(lr)
    return ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                resource=Resource(attributes=key_values(res)),
                scope_logs=[ScopeLogs(scope=SCOPE, log_records=records, schema_url=SCHEMA_URL)],
                schema_url=SCHEMA_URL,
            )
            for res, records in by_resource.items()
        ]
    )
