"""gpupipe_consumers.metrics.store: golden exposition, XID counters, staleness, partitions (pure).

Golden files: ``tests/fixtures/metrics/*.prom``. After an intended change of the output, run
``UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/consumers/metrics/test_store.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from gpupipe_consumers.metrics.collectors_csv import all_counters, default_counters
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore, UnusableSample
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "metrics"
FLEET = json.loads((FIXTURES / "fleet.json").read_text())
T_MS = FLEET["timestamp_ms"]
NOW = T_MS / 1000 + 1.5
SAMPLES_TOPIC, XID_TOPIC = "gpu.samples.v1", "gpu.xid.v1"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def fleet_samples() -> list[dict]:
    """The fixture's samples, through Avro encode/decode (so the fixture must match the schema)."""
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    out = []
    for s in FLEET["samples"]:
        rec = {**FLEET["sample_defaults"], "timestamp_ms": T_MS, **s}
        out.append(codec.decode(enc.encode(rec)).record)
    return out


def fleet_xids() -> list[dict]:
    codec = AvroCodec()
    enc = codec.encoder("XidEvent")
    return [codec.decode(enc.encode({**FLEET["xid_defaults"], **e})).record for e in FLEET["xid_events"]]


def loaded_store(counters=None, options=None, **kw) -> SeriesStore:
    store = SeriesStore(counters if counters is not None else default_counters(), options=options, **kw)
    for i, rec in enumerate(fleet_samples()):
        store.apply_sample(rec, (SAMPLES_TOPIC, i % 3), T_MS / 1000)
    for ev in fleet_xids():
        store.apply_xid(ev, (XID_TOPIC, 0), T_MS / 1000)
    return store


def blank(uuid: str = "GPU-0", **kw) -> dict:
    rec = {f["name"]: f.get("default") for f in catalog.current("GpuSample").raw["fields"]}
    rec.update(
        timestamp_ms=T_MS,
        hostname="node-1",
        gpu_index=0,
        uuid=uuid,
        pci_bus_id="00000000:3B:00.0",
        model_name="NVIDIA H200",
        driver_version="570.124.06",
        allocations=[],
        processes=[],
        gpu_lost=False,
        interval_ms=1000,
        gpu_temp_c=50.0,
    )
    rec.update(kw)
    return rec


def xid(
    code: int | None, uuid: str | None = "GPU-0", event_id: str | None = None, ts: int = T_MS, **kw
) -> dict:
    ev = {
        "event_id": event_id or f"e-{code}-{ts}-{uuid}",
        "timestamp_ms": ts,
        "hostname": "node-1",
        "kind": "xid",
        "xid": code,
        "pci_bus_id": "0000:3b:00",
        "gpu_index": 0,
        "uuid": uuid,
        "model_name": "NVIDIA H200",
        "driver_version": None,
        "pid": None,
        "process_name": None,
        "message": "",
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "nvml",
        "allocations": [],
    }
    ev.update(kw)
    return ev


def alloc(ns: str, pod: str, ctr: str = "main") -> dict:
    return {"namespace": ns, "pod": pod, "container": ctr, "resource_name": "nvidia.com/gpu", "replica": None}


def lines_of(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]


_SUFFIXES = ("", "_total", "_created", "_bucket", "_count", "_sum", "_info")


def check_exposition(text: str) -> dict[str, str]:
    """Every family has one HELP and one TYPE, then all its samples, contiguous; returns name -> type."""
    types: dict[str, str] = {}
    helps: set[str] = set()
    current = None
    for n, line in enumerate(text.splitlines(), 1):
        assert line, f"line {n}: empty line"
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"line {n}: second HELP for {name}"
            helps.add(name)
            current = name
        elif line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ")
            assert name == current and name not in types, f"line {n}: TYPE {name} out of place"
            types[name] = typ
        else:
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$", line)
            assert m, f"line {n}: not a sample line: {line!r}"
            assert current is not None and m.group(1) in {current + s for s in _SUFFIXES}, (
                f"line {n}: sample of {m.group(1)} outside its family (current {current})"
            )
            float(m.group(3))
    assert helps == set(types)
    parsed = [f.name for f in text_string_to_metric_families(text)]
    assert len(parsed) == len(set(parsed)), "a family appears twice"
    return types


# -- golden ----------------------------------------------------------------------------------------
def _golden(name: str, text: str) -> None:
    path = FIXTURES / name
    if UPDATE or not path.exists():
        path.write_text(text)
        if not UPDATE:
            pytest.fail(f"golden file {path} was missing and has been written; review it and rerun")
    assert text == path.read_text(), f"output differs from {path}; UPDATE_GOLDEN=1 regenerates it"


def test_golden_default_counters():
    text = loaded_store().render(NOW).decode()
    check_exposition(text)
    _golden("fleet_default.prom", text)


def test_golden_all_fields_lowercase_hostname():
    store = loaded_store(all_counters(), RenderOptions(host_label="hostname"))
    text = store.render(NOW).decode()
    check_exposition(text)
    assert "Hostname=" not in text and 'hostname="dgx-a01"' in text
    _golden("fleet_all_fields_hostname.prom", text)


def test_fixture_shape():
    store = loaded_store()
    assert len(fleet_samples()) == 14
    # 8 whole GPUs + MIG parent + 3 slices + 2 T4s, plus one GPU known only from an XID event
    assert store.gpu_count() == 15
    text = store.render(NOW).decode()
    # 8 H100s, the 3 MIG instances (the parent's temperature, no parent series), the shared T4 once,
    # the idle T4
    assert len(lines_of(text, "DCGM_FI_DEV_GPU_TEMP")) == 8 + 3 + 1 + 1
    assert len(lines_of(text, "gpupipe_sample_age_seconds")) == 14
    assert all(ln.endswith(" 1.500") for ln in lines_of(text, "gpupipe_sample_age_seconds"))
    assert store.stats()["xid_events"] == {"counted": 7, "duplicate": 1, "ignored": 2, "unattributed": 1}


@pytest.mark.integration
def test_promtool_check_metrics():
    """promtool lints the exposition: no parse error; only naming complaints that dcgm-exporter's
    names and labels force on us (camelCase labels such as modelName; its counters' names)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package 'prometheus'"
    for counters in (default_counters(), all_counters()):
        store = loaded_store(counters)
        store.apply_sample(
            blank("GPU-odd", power_w=float("nan"), gpu_util_ratio=-1.0), (SAMPLES_TOPIC, 0), T_MS / 1000
        )
        text = store.render(NOW)
        proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
        out = (proc.stdout + proc.stderr).decode()
        assert proc.returncode != 1, out
        for line in out.splitlines():
            name, _, problem = line.partition(" ")
            if problem == "label names should be written in 'snake_case' not 'camelCase'":
                continue
            # dcgm-exporter's own counter names, which we must keep for compatibility
            assert name.startswith("DCGM_") and problem in (
                'counter metrics should have "_total" suffix',
                "metric name should not include type 'counter'",
            ), line


# -- exposition ------------------------------------------------------------------------------------
def test_every_family_once_and_contiguous():
    store = loaded_store(all_counters())
    types = check_exposition(store.render(NOW).decode())
    assert types["DCGM_EXP_XID_ERRORS_TOTAL"] == "counter"
    assert types["gpupipe_sample_age_seconds"] == "gauge"
    assert types["gpupipe_metrics_xid_events_total"] == "counter"


def test_empty_store_renders_own_metrics_only():
    text = SeriesStore().render(NOW).decode()
    check_exposition(text)
    assert "gpupipe_metrics_gpus 0\n" in text
    assert "DCGM_" not in text


def test_registry_appended_without_duplicate_families():
    reg = CollectorRegistry()
    c = Counter("gpupipe_metrics_records", "Records consumed.", registry=reg)
    c.inc(3)
    Gauge("DCGM_FI_DEV_GPU_TEMP", "a clashing family", registry=reg).set(1)
    Gauge("gpupipe_metrics_gpus", "another clash", registry=reg).set(99)
    store = loaded_store(registry=reg)
    text = store.render(NOW).decode()
    check_exposition(text)
    assert "gpupipe_metrics_records_total 3.0\n" in text
    assert "a clashing family" not in text and "another clash" not in text
    assert "gpupipe_metrics_gpus 15\n" in text


def test_render_parts_cache_and_render_agree():
    store = loaded_store()
    *body1, tail1 = store.render_parts(NOW)
    *body2, _ = store.render_parts(NOW + 1)
    assert len(body1) > 1 and all(c.startswith(b"# HELP ") for c in body1)  # one chunk per family
    # nothing changed: the same objects (the HTTP layer reuses their gzip)
    assert all(a is b for a, b in zip(body1, body2, strict=True))
    assert store.render(NOW) == b"".join(body1) + tail1
    store.apply_sample(blank(), ("s", 0), NOW)
    *body3, _ = store.render_parts(NOW)
    assert body3[0] is not body1[0]
    assert store.render(NOW).startswith(b"".join(body3))


def test_sample_age_computed_at_scrape():
    store = SeriesStore()
    store.apply_sample(blank(timestamp_ms=T_MS), 0, T_MS / 1000)
    (line,) = lines_of(store.render(T_MS / 1000 + 2.25).decode(), "gpupipe_sample_age_seconds")
    assert line == (
        'gpupipe_sample_age_seconds{gpu="0",UUID="GPU-0",pci_bus_id="00000000:3B:00.0",device="nvidia0",'
        'modelName="NVIDIA H200",Hostname="node-1",DCGM_FI_DRIVER_VERSION="570.124.06"} 2.250'
    )


# -- XID -------------------------------------------------------------------------------------------
def test_xid_counter_counts_and_deduplicates():
    store = SeriesStore()
    store.apply_sample(blank(), 0, NOW)
    assert store.apply_xid(xid(13, event_id="a"), 1, NOW)
    assert not store.apply_xid(xid(13, event_id="a"), 1, NOW)  # producer retry: same event id
    assert store.apply_xid(xid(13, event_id="b", ts=T_MS + 5), 1, NOW)
    assert store.apply_xid(xid(48, event_id="c", ts=T_MS + 1), 1, NOW)
    text = store.render(NOW).decode()
    assert [ln.split("xid=")[1] for ln in lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL")] == [
        '"13"} 2',
        '"48"} 1',
    ]
    # last XID by event time: 13 (T+5) is newer than 48 (T+1)
    assert lines_of(text, "DCGM_FI_DEV_XID_ERRORS")[0].endswith("} 13")
    assert store.stats()["xid_events"]["duplicate"] == 1


def test_xid_counter_is_monotonic_across_samples():
    store = SeriesStore()
    for k in range(5):
        store.apply_sample(blank(timestamp_ms=T_MS + k * 1000, gpu_temp_c=50.0 + k), 0, NOW + k)
        store.apply_xid(xid(31, event_id=f"x{k}"), 1, NOW + k)
        (line,) = lines_of(store.render(NOW + k).decode(), "DCGM_EXP_XID_ERRORS_TOTAL")
        assert line.endswith(f'xid="31"}} {k + 1}')


def test_last_xid_from_sample_until_an_event_arrives():
    store = SeriesStore()
    store.apply_sample(blank(last_xid=43), 0, NOW)
    assert lines_of(store.render(NOW).decode(), "DCGM_FI_DEV_XID_ERRORS")[0].endswith("} 43")
    store.apply_xid(xid(94), 1, NOW)
    store.apply_sample(blank(last_xid=43), 0, NOW)
    assert lines_of(store.render(NOW).decode(), "DCGM_FI_DEV_XID_ERRORS")[0].endswith("} 94")
    store.apply_xid(xid(13, ts=T_MS - 10_000), 1, NOW)  # an older event does not become "last"
    assert lines_of(store.render(NOW).decode(), "DCGM_FI_DEV_XID_ERRORS")[0].endswith("} 94")


def test_xid_ignored_and_unattributed():
    store = SeriesStore()
    store.apply_sample(blank(), 0, NOW)
    assert not store.apply_xid(xid(12028, kind="sxid"), 1, NOW)
    assert not store.apply_xid(xid(None, kind="gpu_lost"), 1, NOW)
    assert not store.apply_xid(xid(None, kind="fallen_off_bus"), 1, NOW)
    assert not store.apply_xid(xid(0), 1, NOW)
    assert not store.apply_xid(xid(13, uuid=None, pci_bus_id="0000:99:00", event_id="u1"), 1, NOW)
    assert store.apply_xid(xid(13, uuid=None, pci_bus_id="0000:3b:00.0", event_id="u2"), 1, NOW)  # by bus id
    assert store.stats()["xid_events"] == {"counted": 1, "duplicate": 0, "ignored": 4, "unattributed": 1}
    assert lines_of(store.render(NOW).decode(), "DCGM_EXP_XID_ERRORS_TOTAL")[0].startswith(
        'DCGM_EXP_XID_ERRORS_TOTAL{gpu="0",UUID="GPU-0",'
    )


def test_xid_before_any_sample_then_sample_labels_take_over():
    store = SeriesStore()
    store.apply_xid(xid(79, uuid="GPU-9", gpu_index=2, pci_bus_id="0000:5d:00", hostname="n9"), 1, NOW)
    text = store.render(NOW).decode()
    assert lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL") == [
        'DCGM_EXP_XID_ERRORS_TOTAL{gpu="2",UUID="GPU-9",pci_bus_id="00000000:5D:00.0",device="nvidia2",'
        'modelName="NVIDIA H200",Hostname="n9",xid="79"} 1'
    ]
    assert lines_of(text, "gpupipe_sample_age_seconds") == []
    rec = blank(
        "GPU-9", gpu_index=2, hostname="n9", pci_bus_id="00000000:5D:00.0", allocations=[alloc("a", "p")]
    )
    store.apply_sample(rec, 0, NOW)
    text = store.render(NOW).decode()
    (total,) = lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL")
    # 4.8.3: the counter carries the pod labels of the GPU's current pod, like every family
    assert total.endswith(
        'DCGM_FI_DRIVER_VERSION="570.124.06",xid="79",container="main",namespace="a",pod="p"} 1'
    )
    (last,) = lines_of(text, "DCGM_FI_DEV_XID_ERRORS")
    assert last.endswith(
        'container="main",err_code="79",err_msg="GPU has fallen off the bus",namespace="a",pod="p"} 79'
    )


def test_xid_on_mig_slice():
    store = SeriesStore()
    mig = {
        "mig_uuid": "MIG-1",
        "gpu_instance_id": 3,
        "compute_instance_id": 0,
        "profile": "1g.18gb",
        "slice_fraction": 1 / 7,
    }
    store.apply_sample(blank(mig_enabled=True), 0, NOW)
    store.apply_sample(blank(mig=mig), 0, NOW)
    store.apply_xid(xid(94, mig_uuid="MIG-1", gpu_instance_id=3), 1, NOW)
    store.apply_xid(xid(94, mig_uuid="MIG-unknown", event_id="other"), 1, NOW)  # slice not here: the GPU
    # the GPU's XID (its slice is not here) is its instances' XID too: one series, the instance's,
    # counting both (no series of the hidden parent, as dcgm-exporter's -d f)
    (line,) = lines_of(store.render(NOW).decode(), "DCGM_EXP_XID_ERRORS_TOTAL")
    assert 'GPU_I_ID="3"' in line and line.endswith(',xid="94"} 2')


# -- lifecycle -------------------------------------------------------------------------------------
def test_pod_change_relabels_at_next_sample():
    store = SeriesStore()
    store.apply_sample(blank(allocations=[alloc("a", "pod-1")]), 0, NOW)
    assert 'pod="pod-1"' in lines_of(store.render(NOW).decode(), "DCGM_FI_DEV_GPU_TEMP")[0]
    store.apply_sample(blank(allocations=[alloc("b", "pod-2")]), 0, NOW + 1)
    (line,) = lines_of(store.render(NOW + 1).decode(), "DCGM_FI_DEV_GPU_TEMP")
    assert 'namespace="b",pod="pod-2"' in line
    store.apply_sample(blank(allocations=[]), 0, NOW + 2)  # the pod ended
    (line,) = lines_of(store.render(NOW + 2).decode(), "DCGM_FI_DEV_GPU_TEMP")
    assert "pod=" not in line
    store.apply_sample(blank(allocations=[alloc("a", "x"), alloc("b", "y")]), 0, NOW + 3)  # now shared
    (line,) = lines_of(store.render(NOW + 3).decode(), "DCGM_FI_DEV_GPU_TEMP")  # one series, as dcgm-exporter
    assert 'namespace="b",pod="y"' in line


def beat(store: SeriesStore, now_s: float, uuid: str = "GPU-beat", host: str = "node-9") -> None:
    """Another GPU of the input goes on reporting (the input progresses); it never goes stale."""
    store.apply_sample(blank(uuid, hostname=host, interval_ms=3_600_000), 0, now_s)


def test_staleness_from_interval():
    store = SeriesStore()
    store.apply_sample(blank("GPU-fast", interval_ms=1000), 0, 100.0)
    store.apply_sample(blank("GPU-slow", interval_ms=10_000), 0, 100.0)
    store.apply_sample(blank("GPU-unknown", interval_ms=None), 0, 100.0)
    beat(store, 102.9)
    assert store.expire(102.9) == 0
    beat(store, 103.1)
    assert store.expire(103.1) == 1
    assert sorted(store.keys()) == ["GPU-beat", "GPU-slow", "GPU-unknown"]
    beat(store, 130.1)
    assert store.expire(130.1) == 1
    assert sorted(store.keys()) == ["GPU-beat", "GPU-unknown"]
    beat(store, 190.1)
    assert store.expire(190.1) == 1  # fallback interval 30 s x 3
    assert store.stats()["expired"] == 3


def test_staleness_override_and_refresh():
    store = SeriesStore(stale_after_s=5.0)
    store.apply_sample(blank(interval_ms=1000), 0, 100.0)
    store.apply_sample(blank(interval_ms=1000), 0, 104.0)  # seen again: the clock restarts
    beat(store, 108.5)
    assert store.expire(108.5) == 0
    beat(store, 109.5)
    assert store.expire(109.5) == 1


def test_scrape_never_shows_stale_series():
    store = SeriesStore()
    store.apply_sample(blank(), 0, 100.0)
    beat(store, 104.0, host="node-1")  # another GPU of the same node goes on
    text = store.render(104.0).decode()
    assert 'UUID="GPU-0"' not in text
    assert "gpupipe_metrics_expired_total 1\n" in text


def test_after_a_stall_the_partitions_that_resume_first_do_not_expire_the_others():
    """After a pause every partition resumes, but one first: its sample must not make the GPUs of the
    partitions a moment behind it look stale (each was 8 s behind the clock, not behind the input)."""
    store = SeriesStore()
    for t in range(5):
        store.apply_sample(blank("GPU-a", hostname="node-1", timestamp_ms=T_MS + 1000 * t), 0, 100.0 + t)
        store.apply_sample(blank("GPU-b", hostname="node-2", timestamp_ms=T_MS + 1000 * t), 1, 100.0 + t)
    store.apply_sample(blank("GPU-a", hostname="node-1", timestamp_ms=T_MS + 12_000), 0, 112.0)
    text = store.render(112.1).decode()  # partition 1's fresh sample is still on its way
    assert len(lines_of(text, "DCGM_FI_DEV_GPU_TEMP")) == 2 and store.stats()["expired"] == 0
    for t in range(13, 17):  # partition 1 stays silent while partition 0 goes on: that GPU goes
        store.apply_sample(blank("GPU-a", hostname="node-1", timestamp_ms=T_MS + 1000 * t), 0, 100.0 + t)
    store.render(116.1)
    assert store.stats()["expired"] == 1


def test_a_stalled_input_keeps_every_series():
    """Nothing arrives for a minute (a broker stall, a paused producer link): every GPU keeps its
    series, the freshness gauges grow, and once samples flow again nothing was lost. Before, every
    series went 3 s into the pause, which Prometheus recorded as every GPU disappearing."""
    store = SeriesStore()
    for t in range(5):
        for u, host in (("GPU-a", "node-1"), ("GPU-b", "node-1"), ("GPU-c", "node-2")):
            store.apply_sample(blank(u, hostname=host, timestamp_ms=T_MS + 1000 * t), 0, 100.0 + t)
    scrapes = {now: store.render(now).decode() for now in (105.0, 110.0, 130.0, 164.0)}
    assert {
        now: len(lines_of(text, "DCGM_FI_DEV_GPU_TEMP")) for now, text in scrapes.items()
    } == dict.fromkeys(scrapes, 3)  # a scrape every few seconds through the pause: every GPU in each
    for now, text in scrapes.items():
        assert "gpupipe_metrics_expired_total 0\n" in text
        assert f"gpupipe_metrics_pipeline_delay_seconds {now - 104.0:.3f}\n" in text
        ages = lines_of(text, "gpupipe_metrics_node_last_sample_age_seconds")
        want = now - (T_MS + 4000) / 1000
        assert ages == [
            f'gpupipe_metrics_node_last_sample_age_seconds{{Hostname="node-1"}} {want:.3f}',
            f'gpupipe_metrics_node_last_sample_age_seconds{{Hostname="node-2"}} {want:.3f}',
        ]
    assert store.stats()["expired"] == 0
    # the input resumes: the backlog of the pause comes in at once, nothing is missing
    for u, host in (("GPU-a", "node-1"), ("GPU-b", "node-1"), ("GPU-c", "node-2")):
        store.apply_sample(blank(u, hostname=host, timestamp_ms=T_MS + 64_000), 0, 165.0)
    assert len(lines_of(store.render(165.0).decode(), "DCGM_FI_DEV_GPU_TEMP")) == 3


def test_a_gpu_or_node_that_stops_while_others_report_expires():
    """Judged by the input's progress: a GPU whose node keeps reporting, and a node that stops while
    the others go on, still lose their series after 3 of their intervals."""
    store = SeriesStore()
    for t in range(10):
        now = 100.0 + t
        store.apply_sample(blank("GPU-a", hostname="node-1", timestamp_ms=T_MS + 1000 * t), 0, now)
        if t < 2:  # GPU-b (node-1) and node-2's only GPU stop after 2 s
            store.apply_sample(blank("GPU-b", hostname="node-1", timestamp_ms=T_MS + 1000 * t), 0, now)
            store.apply_sample(blank("GPU-c", hostname="node-2", timestamp_ms=T_MS + 1000 * t), 0, now)
        store.expire(now)
        if t == 4:  # last seen at 101, now 104: within 3 intervals
            assert sorted(store.keys()) == ["GPU-a", "GPU-b", "GPU-c"]
    assert store.keys() == ["GPU-a"]
    text = store.render(109.0).decode()
    assert [
        ln.split("{")[1].split("}")[0]
        for ln in lines_of(text, "gpupipe_metrics_node_last_sample_age_seconds")
    ] == ['Hostname="node-1"']  # a node with no GPU left has no freshness series


def test_xid_only_gpu_expiry():
    store = SeriesStore(xid_only_stale_after_s=60.0)
    store.apply_xid(xid(13, uuid="GPU-x"), 1, 100.0)
    assert store.expire(159.0) == 0
    assert store.expire(161.0) == 1


def test_xid_only_gpu_has_its_sample_identity():
    """A GPU known only from gpu.xid events (the consumer read its XID before its first sample, or it
    fell off the bus before one): the event's identity and pods label it, so its XID series keep their
    identity when the first sample comes, as dcgm-exporter's always carry the GPU and its pod. Before:
    no pod labels until the first sample, so `DCGM_FI_DEV_XID_ERRORS == 79` alerts resolved and fired
    again with new labels."""
    store = SeriesStore()
    ev = xid(79, driver_version="570.124.06", allocations=[alloc("ns", "p")])
    store.apply_xid(ev, 1, NOW)
    names = ("DCGM_FI_DEV_XID_ERRORS", "DCGM_EXP_XID_ERRORS_TOTAL")
    before = [lines_of(store.render(NOW).decode(), n) for n in names]
    assert (
        'container="main",err_code="79",err_msg="GPU has fallen off the bus",namespace="ns",pod="p"'
        in (before[0][0])
    )
    store.apply_sample(blank(allocations=[alloc("ns", "p")], last_xid=79), 0, NOW)
    assert [lines_of(store.render(NOW).decode(), n) for n in names] == before


def test_drop_partitions():
    store = SeriesStore()
    store.apply_sample(blank("GPU-a"), ("s", 0), NOW)
    store.apply_sample(blank("GPU-b"), ("s", 1), NOW)
    store.apply_sample(blank("GPU-c"), ("s", 1), NOW)
    store.apply_xid(xid(13, uuid="GPU-c"), ("x", 1), NOW)
    store.apply_xid(xid(31, uuid="GPU-a"), ("x", 0), NOW)
    assert store.partition_of("GPU-b") == ("s", 1)
    assert store.drop_partitions([("s", 1)]) == 1  # GPU-b gone; GPU-c keeps its XID counter
    assert sorted(store.keys()) == ["GPU-a", "GPU-c"]
    text = store.render(NOW).decode()
    assert [ln.split(",")[1] for ln in lines_of(text, "DCGM_FI_DEV_GPU_TEMP")] == ['UUID="GPU-a"']
    assert len(lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL")) == 2
    assert len(lines_of(text, "gpupipe_sample_age_seconds")) == 1
    assert store.drop_partitions([("x", 1)]) == 1  # now GPU-c has nothing left
    assert store.drop_partitions([("x", 0)]) == 0  # GPU-a keeps its sample, loses its counter
    text = store.render(NOW).decode()
    assert lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL") == []
    assert store.keys() == ["GPU-a"]
    check_exposition(text)


def test_drop_partitions_of_the_fixture():
    store = loaded_store()
    store.drop_partitions([(SAMPLES_TOPIC, 0), (SAMPLES_TOPIC, 1), (SAMPLES_TOPIC, 2), (XID_TOPIC, 0)])
    assert store.gpu_count() == 0
    text = store.render(NOW).decode()
    assert "DCGM_" not in text


# -- records ---------------------------------------------------------------------------------------
def test_projected_record_missing_metric_fields():
    store = SeriesStore()
    rec = {
        "timestamp_ms": T_MS,
        "hostname": "h",
        "gpu_index": 1,
        "uuid": "GPU-p",
        "pci_bus_id": "00000000:01:00.0",
        "model_name": "m",
        "gpu_temp_c": 40.0,
    }
    store.apply_sample(rec, 0, NOW)
    assert lines_of(store.render(NOW).decode(), "DCGM_FI_DEV_GPU_TEMP")[0].endswith("} 40")


def test_record_without_identity_is_rejected():
    store = SeriesStore()
    with pytest.raises(UnusableSample):
        store.apply_sample({"timestamp_ms": 1}, 0, NOW)
    with pytest.raises(UnusableSample, match="hostname"):
        store.apply_sample({"uuid": "GPU-x", "timestamp_ms": 1}, 0, NOW)
    with pytest.raises(UnusableSample, match="KeyError"):
        store.apply_sample(blank("GPU-y", allocations=[{"namespace": "a"}]), 0, NOW)
    with pytest.raises(UnusableSample, match="TypeError"):
        store.apply_sample(blank("GPU-z", allocations=[None, None]), 0, NOW)
    assert store.gpu_count() == 0  # nothing half-made is left behind
    check_exposition(store.render(NOW).decode())


def test_concurrent_ingest_and_scrape():
    store = SeriesStore()
    stop = threading.Event()
    errors: list[BaseException] = []

    def ingest() -> None:
        k = 0
        try:
            while not stop.is_set():
                k += 1
                store.apply_sample(blank(f"GPU-{k % 50}", allocations=[alloc("a", f"p{k % 7}")]), k % 4, NOW)
                if k % 10 == 0:
                    store.apply_xid(xid(13, uuid=f"GPU-{k % 50}", event_id=str(k)), 9, NOW)
                if k % 97 == 0:
                    store.drop_partitions([k % 4])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=ingest)
    t.start()
    try:
        for _ in range(60):
            check_exposition(store.render(NOW).decode())
    finally:
        stop.set()
        t.join()
    assert not errors
