"""GpuSample / XidEvent -> OTLP messages: names, units and attributes against the semantic
conventions' own YAML (tests/fixtures/otel/), and the values converted exactly."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality, NumberDataPoint

from gpupipe_consumers.otlp import mapping
from gpupipe_schemas.xid_catalog import CATALOG_VERSION, lookup
from tests.otlp_records import MIG_UUID, T_MS, UUID, alloc, attrs, num, points, sample, xid
from tests.paths import TESTS

SEMCONV = yaml.safe_load((TESTS / "fixtures" / "otel" / "semconv-hardware-v1.44.0.yaml").read_text())
REFINED = {r["metric"]: r["attributes"] for k, r in SEMCONV["metric_refinements"].items() if ".gpu." in k}


def find(req: Any, name: str, **want: Any) -> list[Any]:
    return [
        (pa, dp)
        for _, m, pa, dp in points(req)
        if m.name == name and all(pa.get(k) == v for k, v in want.items())
    ]


def one(req: Any, name: str, **want: Any) -> Any:
    hits = find(req, name, **want)
    assert len(hits) == 1, (name, want, hits)
    return hits[0][1]


def allowed_attribute(key: str) -> bool:
    return key.startswith("gpupipe.") or key in SEMCONV["attributes"] or key.startswith("k8s.pod.label.")


@pytest.mark.parametrize(
    "rec",
    [
        sample(),
        sample(
            mig={
                "mig_uuid": MIG_UUID,
                "gpu_instance_id": 1,
                "compute_instance_id": 0,
                "profile": "1g.18gb",
                "slice_fraction": 1 / 7,
            }
        ),
        sample(gpu_lost=True, allocations=[], allocations_known=False),
    ],
    ids=["whole-gpu", "mig-slice", "lost-unattributed"],
)
def test_every_name_unit_and_attribute_is_the_conventions(rec: dict[str, Any]) -> None:
    req = mapping.metrics_request([rec])
    seen = set()
    for res, m, pa, _dp in points(req):
        seen.add(m.name)
        ins = mapping.INSTRUMENTS[m.name]
        assert m.unit == ins.unit
        if m.name.startswith("hw."):
            conv = SEMCONV["metrics"][m.name]
            assert (m.unit, ins.kind.replace("delta_", "")) == (conv["unit"], conv["instrument"]), m.name
            allowed = set(REFINED.get(m.name, conv["attributes"]))
            extra = {k for k in pa if k not in allowed and not k.startswith("gpupipe.")}
            assert not extra, (m.name, extra)
            for req_attr in ("hw.id", *(("hw.type",) if "hw.type" in conv["attributes"] else ())):
                assert req_attr in pa, (m.name, req_attr)
        else:
            assert m.name.startswith("gpupipe.gpu."), m.name
            assert all(allowed_attribute(k) for k in pa), (m.name, pa)
        if ins.kind == "gauge":
            assert m.HasField("gauge")
        else:
            assert m.sum.is_monotonic == (ins.kind != "updowncounter")
        for k, v in pa.items():  # enum attributes take the conventions' members
            members = SEMCONV["attributes"].get(k, {}).get("members")
            if members and k != "error.type":
                assert v in members, (k, v)
        assert all(allowed_attribute(k) for k in res), res
    assert {"hw.status", "hw.gpu.utilization", "hw.power", "hw.energy", "hw.temperature"} <= seen
    assert req.resource_metrics[0].schema_url.endswith("/" + mapping.SEMCONV_VERSION)


def test_values_are_converted_exactly() -> None:
    req = mapping.metrics_request([sample()])
    assert num(one(req, "hw.gpu.utilization", **{"hw.gpu.task": "general"})) == 0.75
    assert num(one(req, "hw.gpu.utilization", **{"hw.gpu.task": "decoder"})) == 0.125
    assert num(one(req, "hw.gpu.memory.usage")) == 40 * 2**30
    assert num(one(req, "hw.gpu.memory.limit")) == 80 * 2**30
    assert num(one(req, "hw.gpu.memory.utilization")) == 0.5
    assert num(one(req, "hw.power")) == 512.5
    energy = one(req, "hw.energy")
    assert num(energy) == pytest.approx(123_456.789)
    assert num(one(req, "hw.temperature", **{"hw.sensor_location": "memory"})) == 70.0
    assert num(one(req, "hw.errors", **{"error.type": "corrected"})) == 7
    assert num(one(req, "hw.status", **{"hw.state": "ok"})) == 1
    assert num(one(req, "hw.status", **{"hw.state": "failed"})) == 0
    rx = one(req, "hw.gpu.io", **{"network.io.direction": "receive"})
    assert (num(rx), rx.start_time_unix_nano, rx.time_unix_nano) == (
        2_000_000,
        (T_MS - 1000) * 1_000_000,
        T_MS * 1_000_000,
    )
    assert num(one(req, "gpupipe.gpu.nvlink.links", **{"gpupipe.nvlink.state": "down"})) == 1
    assert num(one(req, "gpupipe.gpu.nvlink.errors", **{"error.type": "replay"})) == 4
    assert num(one(req, "gpupipe.gpu.nvlink.throughput", **{"network.io.direction": "transmit"})) == 3.0e9
    for _, m, _, dp in points(req):
        assert dp.time_unix_nano == T_MS * 1_000_000, m.name
    temporality = {m.name: m.sum.aggregation_temporality for _, m, _, _ in points(req) if m.HasField("sum")}
    assert temporality["hw.gpu.io"] == AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
    assert temporality["hw.energy"] == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    pa, _ = find(req, "hw.gpu.utilization", **{"hw.gpu.task": "general"})[0]
    assert pa == {
        "hw.id": UUID,
        "hw.name": "gpu3",
        "hw.vendor": "NVIDIA",
        "hw.model": "NVIDIA H200",
        "hw.driver_version": "570.124.06",
        "hw.serial_number": "1650924060000",
        "hw.firmware_version": "96.00.AF.00.01",
        "gpupipe.gpu.index": 3,
        "gpupipe.gpu.pci_bus_id": "00000000:3B:00.0",
        "hw.gpu.task": "general",
    }
    power_attrs, _ = find(req, "hw.power")[0]
    assert power_attrs["hw.type"] == "gpu" and "hw.model" not in power_attrs
    temp_attrs, _ = find(req, "hw.temperature", **{"hw.sensor_location": "gpu"})[0]
    assert (temp_attrs["hw.id"], temp_attrs["hw.parent"]) == (f"{UUID}/temperature/gpu", UUID)


def test_null_fields_give_no_points() -> None:
    req = mapping.metrics_request(
        [
            sample(
                power_w=None,
                total_energy_mj=None,
                fb_total_bytes=None,
                pcie_window_ms=None,
                nvlink_links=None,
            )
        ]
    )
    names = {m.name for _, m, _, _ in points(req)}
    assert not names & {
        "hw.power",
        "hw.energy",
        "hw.gpu.memory.limit",
        "hw.gpu.memory.utilization",
        "hw.gpu.io",
    }
    assert "gpupipe.gpu.nvlink.links" not in names
    assert "hw.gpu.memory.usage" in names


def test_mig_slice_is_its_own_component_under_its_gpu() -> None:
    mig = {
        "mig_uuid": MIG_UUID,
        "gpu_instance_id": 2,
        "compute_instance_id": 0,
        "profile": "3g.71gb",
        "slice_fraction": 3 / 7,
    }
    req = mapping.metrics_request([sample(mig=mig)])
    pa, _ = find(req, "hw.gpu.memory.usage")[0]
    assert pa["hw.id"] == MIG_UUID and pa["hw.parent"] == UUID
    assert (pa["gpupipe.mig.profile"], pa["gpupipe.mig.gpu_instance_id"]) == ("3g.71gb", 2)
    assert pa["gpupipe.mig.slice_fraction"] == pytest.approx(3 / 7)


def test_resource_per_pod_and_for_the_node() -> None:
    shared = sample(
        allocations=[
            alloc(
                "a",
                "p0",
                replica=0,
                resource_name="nvidia.com/gpu.shared",
                owner_kind="Deployment",
                owner_name="web",
            ),
            alloc("b", "p1", replica=1, resource_name="nvidia.com/gpu.shared"),
        ]
    )
    free = sample(uuid="GPU-free", allocations=[])
    unknown = sample(uuid="GPU-unknown", allocations=[], allocations_known=False)
    req = mapping.metrics_request([shared, free, unknown])
    resources = [attrs(rm.resource.attributes) for rm in req.resource_metrics]
    assert resources[0] == {
        "host.name": "node-a",
        "k8s.node.name": "node-a",
        "k8s.namespace.name": "a",
        "k8s.pod.name": "p0",
        "k8s.container.name": "main",
        "k8s.deployment.name": "web",
        "gpupipe.k8s.resource_name": "nvidia.com/gpu.shared",
        "gpupipe.gpu.replica": 0,
        "gpupipe.gpu.shared_by": 2,
        "gpupipe.k8s.attribution": "allocated",
    }
    assert resources[1]["k8s.pod.name"] == "p1" and resources[1]["gpupipe.gpu.replica"] == 1
    assert resources[2] == {
        "host.name": "node-a",
        "k8s.node.name": "node-a",
        "gpupipe.k8s.attribution": "unallocated",
    }
    assert resources[3]["gpupipe.k8s.attribution"] == "unknown"
    # the shared GPU's readings are under both pods; each resource has one Metric per name
    for rm in req.resource_metrics[:2]:
        names = [m.name for m in rm.scope_metrics[0].metrics]
        assert len(names) == len(set(names)) and "hw.power" in names
    one_pod = mapping.metrics_request([sample()])
    res = attrs(one_pod.resource_metrics[0].resource.attributes)
    assert res["k8s.job.name"] == "train" and res["k8s.pod.label.team"] == "a"


def test_xid_log_record() -> None:
    req = mapping.logs_request([xid()])
    (rl,) = req.resource_logs
    assert attrs(rl.resource.attributes)["k8s.pod.name"] == "train-0"
    (lr,) = rl.scope_logs[0].log_records
    assert (lr.severity_number, lr.severity_text) == (21, "CRITICAL")
    assert lr.body.string_value == "GPU has fallen off the bus."
    assert lr.time_unix_nano == T_MS * 1_000_000 and lr.event_name == "gpupipe.xid"
    a = attrs(lr.attributes)
    info = lookup(79)
    assert a == {
        "hw.type": "gpu",
        "hw.vendor": "NVIDIA",
        "hw.id": UUID,
        "hw.model": "NVIDIA H200",
        "hw.driver_version": "570.124.06",
        "gpupipe.gpu.index": 3,
        "gpupipe.gpu.pci_bus_id": "0000:3b:00",
        "process.pid": 4242,
        "process.executable.name": "python3",
        "gpupipe.xid.event_id": "ev-1",
        "gpupipe.xid.kind": "xid",
        "gpupipe.xid.source": "kmsg",
        "gpupipe.xid.code": 79,
        "gpupipe.xid.name": "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        "gpupipe.xid.cause": "bus",
        "gpupipe.xid.action": "RESTART_BM",
        "gpupipe.xid.nvidia_action": "RESTART_BM",
        "gpupipe.xid.drain_node": True,
        "gpupipe.xid.runbook": info.runbook,
        "gpupipe.xid.known": True,
        "gpupipe.xid.catalog_version": CATALOG_VERSION,
        "gpupipe.node.boot_id": "b0",
    }
    assert all(allowed_attribute(k) for k in a)


@pytest.mark.parametrize(
    ("over", "number", "text"),
    [
        ({"xid": 13}, 13, "WARNING"),
        ({"xid": 63}, 9, "INFO"),
        ({"xid": 60_000}, 13, "WARNING"),  # unknown code: the catalog's safe default
        ({"kind": "gpu_lost", "xid": None}, 21, "CRITICAL"),
        ({"kind": "driver_loaded", "xid": None, "pci_bus_id": ""}, 9, "INFO"),
    ],
)
def test_xid_severity_mapping(over: dict[str, Any], number: int, text: str) -> None:
    lr = mapping.logs_request([xid(**over)]).resource_logs[0].scope_logs[0].log_records[0]
    assert (lr.severity_number, lr.severity_text) == (number, text)


def test_xid_seen_only_by_nvml_gets_the_catalog_description_as_body() -> None:
    rec = xid(
        message="",
        source="nvml",
        xid=48,
        mig_uuid=MIG_UUID,
        gpu_instance_id=1,
        compute_instance_id=0,
        allocations=[],
    )
    (rl,) = mapping.logs_request([rec]).resource_logs
    lr = rl.scope_logs[0].log_records[0]
    assert lr.body.string_value == f"Xid 48: {lookup(48).description}"
    a = attrs(lr.attributes)
    assert (a["hw.id"], a["hw.parent"], a["gpupipe.mig.gpu_instance_id"]) == (MIG_UUID, UUID, 1)
    assert attrs(rl.resource.attributes)["gpupipe.k8s.attribution"] == "unallocated"


def test_an_xid_hitting_two_pods_is_logged_under_each() -> None:
    rec = xid(allocations=[alloc("a", "p0"), alloc("b", "p1")])
    req = mapping.logs_request([rec])
    pods = [attrs(rl.resource.attributes)["k8s.pod.name"] for rl in req.resource_logs]
    assert pods == ["p0", "p1"]
    ids = {
        attrs(rl.scope_logs[0].log_records[0].attributes)["gpupipe.xid.event_id"] for rl in req.resource_logs
    }
    assert ids == {"ev-1"}


def reference_request(samples: list[dict[str, Any]]) -> ExportMetricsServiceRequest:
    """The same request built with the generated message classes, as the encoder's yardstick."""

    def kvs(pairs: Any) -> list[KeyValue]:
        out = []
        for k, v in pairs:
            any_v = (
                AnyValue(bool_value=v)
                if isinstance(v, bool)
                else AnyValue(int_value=v)
                if isinstance(v, int)
                else AnyValue(double_value=v)
                if isinstance(v, float)
                else AnyValue(string_value=v)
            )
            out.append(KeyValue(key=k, value=any_v))
        return out

    by_res: dict[Any, dict[str, list[NumberDataPoint]]] = {}
    for rec in samples:
        for res in mapping.resource_attrs(rec):
            for name, pa, value, start in mapping.sample_points(rec):
                dp = NumberDataPoint(
                    attributes=kvs(pa),
                    time_unix_nano=rec["timestamp_ms"] * 1_000_000,
                    start_time_unix_nano=start,
                )
                if isinstance(value, int):
                    dp.as_int = value
                else:
                    dp.as_double = value
                by_res.setdefault(res, {}).setdefault(name, []).append(dp)
    req = ExportMetricsServiceRequest()
    for res, metrics in by_res.items():
        rm = req.resource_metrics.add(schema_url=mapping.SCHEMA_URL)
        rm.resource.attributes.extend(kvs(res))
        sm = rm.scope_metrics.add(schema_url=mapping.SCHEMA_URL)
        sm.scope.name = "gpupipe"
        for name, dps in metrics.items():
            ins = mapping.INSTRUMENTS[name]
            m = sm.metrics.add(name=name, unit=ins.unit, description=ins.description)
            if ins.kind == "gauge":
                m.gauge.data_points.extend(dps)
            else:
                m.sum.data_points.extend(dps)
                m.sum.is_monotonic = ins.kind != "updowncounter"
                m.sum.aggregation_temporality = (
                    AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
                    if ins.kind == "delta_counter"
                    else AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
                )
    return req


def test_the_wire_encoder_writes_what_the_generated_classes_would() -> None:
    mig = {
        "mig_uuid": MIG_UUID,
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g.18gb",
        "slice_fraction": 1 / 7,
    }
    samples = [
        sample(),
        sample(
            uuid="GPU-2",
            gpu_lost=True,
            allocations=[alloc("a", "p0", replica=0), alloc("b", "p1", replica=1)],
        ),
        sample(mig=mig, power_w=-0.0, allocations=[]),
        sample(timestamp_ms=T_MS + 1000, total_energy_mj=2**40),
    ]
    enc = mapping.encode_metrics(samples)
    ref = reference_request(samples)
    assert ExportMetricsServiceRequest.FromString(enc.payload) == ref
    assert enc.items == sum(
        len(m.gauge.data_points) + len(m.sum.data_points)
        for rm in ref.resource_metrics
        for m in rm.scope_metrics[0].metrics
    )
    # int64 attributes below zero take protobuf's ten-byte form
    kv = KeyValue.FromString(mapping._kv_bytes("k", -5))
    assert (kv.key, kv.value.int_value) == ("k", -5)


@pytest.mark.parametrize(("vendor", "hw_vendor"), [("nvidia", "NVIDIA"), ("amd", "AMD"), ("acme", "acme")])
def test_hw_vendor_follows_the_records_vendor(vendor: str, hw_vendor: str) -> None:
    req = mapping.metrics_request([sample(vendor=vendor)])
    pa, _ = find(req, "hw.gpu.utilization", **{"hw.gpu.task": "general"})[0]
    assert pa["hw.vendor"] == hw_vendor
    assert dict(mapping.xid_attrs(xid(vendor=vendor)))["hw.vendor"] == hw_vendor
