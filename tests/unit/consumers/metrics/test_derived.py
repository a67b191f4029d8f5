"""DCGM_EXP_* families, err_code/err_msg and label rows, as dcgm-exporter emits them (pure).

Before: DCGM_EXP_XID_ERRORS_COUNT / CLOCK_EVENTS_COUNT / GPU_HEALTH_STATUS rows were skipped with
a log line (no series, so rules on them never fired) and DCGM_FI_DEV_XID_ERRORS had no err_code.
"""

from __future__ import annotations

from gpupipe_consumers.metrics import derived
from gpupipe_consumers.metrics.collectors_csv import parse_counters
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore
from tests.unit.consumers.metrics.test_store import T_MS, alloc, blank, lines_of, xid

NOW = T_MS / 1000
CSV = """\
DCGM_FI_DEV_XID_ERRORS,      gauge,   Value of the last XID error encountered.
DCGM_EXP_XID_ERRORS_COUNT,   gauge,   XID errors observed during the configured time window.
DCGM_EXP_XID_ERRORS_TOTAL,   counter, Total XID errors observed since exporter start.
DCGM_EXP_CLOCK_EVENTS_COUNT, gauge,   Clock events observed during the configured time window.
DCGM_EXP_CLOCK_EVENTS_TOTAL, counter, Total clock events observed since exporter start (edge-counted).
DCGM_EXP_GPU_HEALTH_STATUS,  gauge,   Current DCGM-reported GPU health status.
DCGM_FI_DRIVER_VERSION,      label,   Driver Version
DCGM_FI_DEV_SERIAL,          label,   Device Serial Number
DCGM_FI_DEV_VBIOS_VERSION,   label,   VBIOS version of the device
"""
BASE = (
    'gpu="0",UUID="GPU-0",pci_bus_id="00000000:3B:00.0",device="nvidia0",modelName="NVIDIA H200",'
    'Hostname="node-1",DCGM_FI_DEV_SERIAL="1650924060001",DCGM_FI_DEV_VBIOS_VERSION="96.00.89.00.01",'
    'DCGM_FI_DRIVER_VERSION="570.124.06"'
)


def store(**opts) -> SeriesStore:
    return SeriesStore(parse_counters(CSV), options=RenderOptions(**opts), stale_after_s=3600)


def sample(ts: int = T_MS, **kw) -> dict:
    return blank(ts_ms=None, timestamp_ms=ts, serial="1650924060001", vbios_version="96.00.89.00.01", **kw)


def test_label_rows_serial_and_vbios_in_sorted_order():
    s = store()
    s.apply_sample(sample(), 0, NOW)
    (line,) = lines_of(s.render(NOW).decode(), "DCGM_FI_DEV_XID_ERRORS")
    assert line == f'DCGM_FI_DEV_XID_ERRORS{{{BASE},err_code="0",err_msg="No Error"}} 0'


def test_err_code_and_err_msg_follow_the_last_xid():
    s = store()
    s.apply_sample(sample(allocations=[alloc("ns", "p")]), 0, NOW)
    s.apply_xid(xid(48, ts=T_MS + 10), 0, NOW)
    (line,) = lines_of(s.render(NOW).decode(), "DCGM_FI_DEV_XID_ERRORS")
    assert line == (
        f'DCGM_FI_DEV_XID_ERRORS{{{BASE},container="main",err_code="48",err_msg="Double Bit ECC Error",'
        'namespace="ns",pod="p"} 48'
    )
    s.apply_xid(xid(999, ts=T_MS + 20), 0, NOW)
    assert 'err_code="999",err_msg="Unknown Error"' in s.render(NOW).decode()


def test_err_msg_is_dcgm_exporters_own_text():
    """err_msg comes from dcgm-exporter's xid_errors.go table, not from gpupipe's XID catalog (whose
    descriptions differ for 104 of its 173 codes, e.g. 13, 31, 45, 94, 119 below), so rules and
    annotations matching on err_msg see the same strings. Real outputs: err_code="0" err_msg="No Error"
    (GPU Operator v25.10, linode/lke-ai-conformance README) and err_code="45" err_msg="Preemptive
    cleanup, due to previous errors -- Most likely to see when running multiple cuda" (NVIDIA/DCGM#235)."""
    want = {
        0: "No Error",
        13: "Graphics Engine Exception",
        31: "GPU memory page fault",
        45: "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",
        48: "Double Bit ECC Error",
        79: "GPU has fallen off the bus",
        94: "Contained ECC error",
        119: "GSP RPC Timeout",
        172: "Uncorrectable SRAM Error",  # the table's last code
        173: "Unknown Error",  # past the table (gpupipe's catalog knows 173: dcgm-exporter does not)
        999: "Unknown Error",
    }
    assert {c: derived.xid_message(c) for c in want} == want
    s = store()
    s.apply_sample(sample(), 0, NOW)
    s.apply_xid(xid(45, ts=T_MS + 10), 0, NOW)
    assert f'err_code="45",err_msg="{want[45]}"' in s.render(NOW).decode()


def test_xid_count_is_windowed_with_a_zero_series_when_empty():
    s = store(xid_window_ms=60_000)
    s.apply_sample(sample(), 0, NOW)
    text = s.render(NOW).decode()
    assert lines_of(text, "DCGM_EXP_XID_ERRORS_COUNT") == [
        f'DCGM_EXP_XID_ERRORS_COUNT{{{BASE},window_size_in_ms="60000"}} 0'
    ]
    s.apply_xid(xid(79, ts=T_MS + 1000, event_id="a"), 0, NOW + 1)
    s.apply_xid(xid(79, ts=T_MS + 2000, event_id="b"), 0, NOW + 2)
    s.apply_xid(xid(13, ts=T_MS + 30_000, event_id="c"), 0, NOW + 30)
    assert lines_of(s.render(NOW + 30).decode(), "DCGM_EXP_XID_ERRORS_COUNT") == [
        f'DCGM_EXP_XID_ERRORS_COUNT{{{BASE},window_size_in_ms="60000",xid="13"}} 1',
        f'DCGM_EXP_XID_ERRORS_COUNT{{{BASE},window_size_in_ms="60000",xid="79"}} 2',
    ]
    # the 79s leave the window at scrape time, with no new event or sample
    assert lines_of(s.render(NOW + 62.5).decode(), "DCGM_EXP_XID_ERRORS_COUNT") == [
        f'DCGM_EXP_XID_ERRORS_COUNT{{{BASE},window_size_in_ms="60000",xid="13"}} 1'
    ]
    text = s.render(NOW + 95).decode()
    assert lines_of(text, "DCGM_EXP_XID_ERRORS_COUNT") == [
        f'DCGM_EXP_XID_ERRORS_COUNT{{{BASE},window_size_in_ms="60000"}} 0'
    ]
    # the total counts since start
    assert [ln.rsplit(" ", 1)[1] for ln in lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL")] == ["1", "2"]


def test_old_xid_outside_the_window_is_not_counted():
    s = store(xid_window_ms=60_000)
    s.apply_sample(sample(), 0, NOW + 600)
    s.apply_xid(xid(79, ts=T_MS), 0, NOW + 600)  # a replayed event 10 minutes old
    assert lines_of(s.render(NOW + 600).decode(), "DCGM_EXP_XID_ERRORS_COUNT")[0].endswith(
        'window_size_in_ms="60000"} 0'
    )


def test_clock_events_count_and_total():
    s = store(clock_window_ms=3000)
    # power cap + hw thermal, then hw thermal only, then none, then hw thermal again
    for i, mask in enumerate((0x4 | 0x40, 0x40, 0, 0x40)):
        s.apply_sample(sample(ts=T_MS + 1000 * i, clock_event_reasons=mask), 0, NOW + i)
    text = s.render(NOW + 3).decode()
    assert lines_of(text, "DCGM_EXP_CLOCK_EVENTS_COUNT") == [
        f'DCGM_EXP_CLOCK_EVENTS_COUNT{{{BASE},clock_event="hw_thermal",window_size_in_ms="3000"}} 2',
    ]  # the first sample (t=0) left the 3 s window at t=3
    assert lines_of(text, "DCGM_EXP_CLOCK_EVENTS_TOTAL") == [
        f'DCGM_EXP_CLOCK_EVENTS_TOTAL{{{BASE},clock_event="power_cap"}} 1',
        f'DCGM_EXP_CLOCK_EVENTS_TOTAL{{{BASE},clock_event="hw_thermal"}} 2',
    ]  # edges: hw_thermal rose at t=0 and t=3


def test_health_status_series_and_values():
    s = store()
    s.apply_sample(sample(), 0, NOW)
    text = s.render(NOW).decode()
    lines = lines_of(text, "DCGM_EXP_GPU_HEALTH_STATUS")
    assert [ln.split('health_watch="')[1].split('"')[0] for ln in lines] == ["MEM", "THERMAL", "POWER", "ALL"]
    assert (
        lines[0]
        == f'DCGM_EXP_GPU_HEALTH_STATUS{{{BASE},health_error_code="DCGM_FR_OK",health_watch="MEM"}} 0'
    )
    # watches no check runs for are not reported as passing: no series, and said once
    assert 'health_watch="PCIE"' not in "\n".join(lines) and 'health_watch="NVLINK"' not in "\n".join(lines)
    assert lines_of(text, "gpupipe_metrics_health_watch_not_run") == [
        f'gpupipe_metrics_health_watch_not_run{{health_watch="{w}"}} 1'
        for w in ("PCIE", "NVLINK", "PMU", "MCU", "SM", "INFOROM", "DRIVER")
    ]
    s.apply_sample(sample(ts=T_MS + 1, ecc_dbe_volatile_total=2, clock_event_reasons=0x40), 0, NOW)
    text = s.render(NOW).decode()
    assert f'{BASE},health_error_code="DCGM_FR_VOLATILE_DBE_DETECTED",health_watch="MEM"}} 20' in text
    assert f'{BASE},health_error_code="DCGM_FR_CLOCK_THROTTLE_THERMAL",health_watch="THERMAL"}} 10' in text
    s.apply_xid(xid(95, ts=T_MS + 2), 0, NOW)
    assert (
        f'{BASE},health_error_code="DCGM_FR_UNCONTAINED_ERROR",health_watch="ALL"}} 20'
        in s.render(NOW).decode()
    )


def test_gpu_lost_fails_all():
    h = dict((w, (v, c)) for w, v, c in derived.sample_health({"gpu_lost": True}))
    assert h["ALL"] == (derived.FAIL, "DCGM_FR_FALLEN_OFF_BUS") and h["MEM"] == (derived.PASS, "DCGM_FR_OK")


def test_window_counts_prune_and_out_of_order():
    w = derived.WindowCounts(100)
    assert w.push(50, (1,)) and w.push(20, (2,)) and not w.push(0, (3,), now_ms=150)
    assert w.counts == {1: 1, 2: 1}
    assert w.prune(120) and w.counts == {1: 1}
    assert not w.prune(121)
    assert w.next_expiry_ms() == 150


def test_mig_instances_take_the_parents_readings_and_xid():
    s = SeriesStore(parse_counters(CSV + "DCGM_FI_DEV_POWER_USAGE, gauge, Power draw (in W).\n"))
    mig = {
        "mig_uuid": "MIG-1",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g.18gb",
        "slice_fraction": 1 / 7,
    }
    s.apply_sample(sample(mig=mig), 0, NOW)
    s.apply_sample(sample(mig_enabled=True, power_w=250.0), 0, NOW)
    (power,) = lines_of(s.render(NOW).decode(), "DCGM_FI_DEV_POWER_USAGE")
    assert 'GPU_I_ID="1"' in power and power.endswith(" 250.000000")  # re-rendered when the parent came
    s.apply_sample(sample(ts=T_MS + 1, mig_enabled=True, power_w=260.0), 0, NOW + 1)
    assert lines_of(s.render(NOW + 1).decode(), "DCGM_FI_DEV_POWER_USAGE")[0].endswith(" 260.000000")


def test_mig_gpu_health_is_per_gpu_and_gpu_xids_reach_every_instance():
    """dcgm-exporter's health collector watches whole GPUs only (a DCGM group of FE_GPU entities,
    gpu_health_collector.go), so a MIG GPU has one set of health series without GPU_I labels, in
    every -d mode; a GPU-wide XID (79 here, no MIG UUID) is the XID of each of its instances. Before:
    health per instance (ALL stayed 0 with an XID 79 in the window), the instances' XID window and
    total did not see the GPU's XID, and the hidden parent exposed a lone XID total of its own."""
    s = store(xid_window_ms=60_000)
    for gi in (1, 2):
        mig = {
            "mig_uuid": f"MIG-{gi}",
            "gpu_instance_id": gi,
            "compute_instance_id": 0,
            "profile": "3g.71gb",
            "slice_fraction": 3 / 7,
        }
        s.apply_sample(sample(mig=mig, allocations=[alloc("ns", f"p{gi}")]), 0, NOW)
    s.apply_sample(sample(mig_enabled=True), 0, NOW)
    s.apply_xid(xid(79, ts=T_MS + 10), 0, NOW)
    text = s.render(NOW).decode()
    health = lines_of(text, "DCGM_EXP_GPU_HEALTH_STATUS")
    assert len(health) == len(derived.RUN_WATCHES) == 4 and not any("GPU_I_ID" in ln for ln in health)
    assert f'{{{BASE},health_error_code="DCGM_FR_FALLEN_OFF_BUS",health_watch="ALL"}} 20' in text
    for gi in (1, 2):
        inst = f'GPU_I_PROFILE="3g.71gb",GPU_I_ID="{gi}"'
        tail = f'xid="79",container="main",namespace="ns",pod="p{gi}"}} 1'
        for fam in ("DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_XID_ERRORS_TOTAL"):
            mine = [ln for ln in lines_of(text, fam) if inst in ln]
            assert len(mine) == 1 and mine[0].endswith(tail), (fam, mine)
    for fam in ("DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_XID_ERRORS_TOTAL"):
        assert len(lines_of(text, fam)) == 2  # the instances only: no series of the parent
    later = s.render(NOW + 61).decode()  # the 79 left the window at scrape time
    assert f'{{{BASE},health_error_code="DCGM_FR_OK",health_watch="ALL"}} 0' in later
    assert all(ln.endswith(" 0") for ln in lines_of(later, "DCGM_EXP_XID_ERRORS_COUNT"))
    assert len(lines_of(later, "DCGM_EXP_XID_ERRORS_COUNT")) == 2
