"""gpupipe_consumers.metrics.render: labels, shared GPUs, odd values (pure; through SeriesStore.render)."""

from __future__ import annotations

import math
import random

import pytest

from gpupipe_consumers.metrics.collectors_csv import all_counters, default_counters, parse_counters
from gpupipe_consumers.metrics.render import (
    Renderer,
    RenderOptions,
    escape_help,
    escape_label_value,
)
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas import catalog
from gpupipe_schemas.validate import reading_max

T_MS = 1_764_460_800_000
NOW = T_MS / 1000 + 1
GiB = 1 << 30
MiB = 1 << 20
UUID = "GPU-12345678-1234-4234-8234-123456789abc"
BASE = (
    f'gpu="3",UUID="{UUID}",pci_bus_id="00000000:3B:00.0",device="nvidia3",'
    'modelName="NVIDIA H200",Hostname="node-1",DCGM_FI_DRIVER_VERSION="570.124.06"'
)


def blank(**kw) -> dict:
    rec = {f["name"]: f.get("default") for f in catalog.current("GpuSample").raw["fields"]}
    rec.update(
        timestamp_ms=T_MS,
        hostname="node-1",
        gpu_index=3,
        uuid=UUID,
        pci_bus_id="00000000:3B:00.0",
        model_name="NVIDIA H200",
        driver_version="570.124.06",
        allocations=[],
        processes=[],
        gpu_lost=False,
        interval_ms=1000,
    )
    rec.update(kw)
    return rec


def alloc(ns: str, pod: str, ctr: str = "main", replica: int | None = None) -> dict:
    return {
        "namespace": ns,
        "pod": pod,
        "container": ctr,
        "resource_name": "nvidia.com/gpu",
        "replica": replica,
    }


def proc(pid: int, ns: str | None, pod: str | None, ctr: str | None = None, **kw) -> dict:
    p = {
        "pid": pid,
        "process_name": "python",
        "used_memory_bytes": None,
        "sm_util_ratio": None,
        "mem_util_ratio": None,
        "namespace": ns,
        "pod": pod,
        "container": ctr,
    }
    p.update(kw)
    return p


def expo(
    *recs: dict, counters=None, options: RenderOptions | None = None, store: SeriesStore | None = None
) -> str:
    s = (
        store
        if store is not None
        else SeriesStore(counters if counters is not None else all_counters(), options=options)
    )
    for r in recs:
        s.apply_sample(r, 0, NOW)
    return s.render(NOW).decode()


def lines_of(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]


def value_of(text: str, name: str) -> str:
    (ln,) = lines_of(text, name)
    return ln.rsplit(" ", 1)[1]


# -- labels ----------------------------------------------------------------------------------------
def test_label_order_whole_gpu_with_pod():
    text = expo(blank(gpu_temp_c=61.0, allocations=[alloc("team-a", "train-0", "trainer")]))
    assert lines_of(text, "DCGM_FI_DEV_GPU_TEMP") == [
        f'DCGM_FI_DEV_GPU_TEMP{{{BASE},container="trainer",namespace="team-a",pod="train-0"}} 61'
    ]


def test_unallocated_gpu_has_no_pod_labels():
    text = expo(blank(gpu_temp_c=40.0))
    assert lines_of(text, "DCGM_FI_DEV_GPU_TEMP") == [f"DCGM_FI_DEV_GPU_TEMP{{{BASE}}} 40"]
    assert "pod=" not in text and "namespace=" not in text and "container=" not in text


def test_mig_labels_and_parent_uuid():
    mig = {
        "mig_uuid": "MIG-aaaa",
        "gpu_instance_id": 5,
        "compute_instance_id": 0,
        "profile": "2g.35gb",
        "slice_fraction": 2 / 7,
    }
    text = expo(blank(mig=mig, sm_active_ratio=0.5, allocations=[alloc("r", "p", "c")]))
    (line,) = lines_of(text, "DCGM_FI_PROF_SM_ACTIVE")
    assert line == (
        f'DCGM_FI_PROF_SM_ACTIVE{{gpu="3",UUID="{UUID}",pci_bus_id="00000000:3B:00.0",device="nvidia3",'
        'modelName="NVIDIA H200",GPU_I_PROFILE="2g.35gb",GPU_I_ID="5",Hostname="node-1",'
        'DCGM_FI_DRIVER_VERSION="570.124.06",container="c",namespace="r",pod="p"} 0.500000'
    )


def test_mig_slices_are_separate_series_keyed_by_mig_uuid():
    def slice_(mu: str, gi: int) -> dict:
        mig = {
            "mig_uuid": mu,
            "gpu_instance_id": gi,
            "compute_instance_id": 0,
            "profile": "1g.18gb",
            "slice_fraction": 1 / 7,
        }
        return blank(mig=mig, sm_active_ratio=0.25)

    s = SeriesStore(all_counters())
    text = expo(blank(mig_enabled=True, power_w=300.0), slice_("MIG-1", 1), slice_("MIG-2", 2), store=s)
    assert sorted(s.keys()) == sorted([UUID, "MIG-1", "MIG-2"])
    assert len(lines_of(text, "DCGM_FI_PROF_SM_ACTIVE")) == 2
    # dcgm-exporter's default (-d f): the parent's power on each instance, no parent series
    power = lines_of(text, "DCGM_FI_DEV_POWER_USAGE")
    assert [ln.rsplit(" ", 1)[1] for ln in power] == ["300.000000", "300.000000"]
    assert all("GPU_I_ID=" in ln for ln in power)
    both = expo(
        blank(mig_enabled=True, power_w=300.0),
        slice_("MIG-1", 1),
        options=RenderOptions(mig_layout="gpu+instances"),
    )
    assert len(lines_of(both, "DCGM_FI_DEV_POWER_USAGE")) == 1  # -d g+i: the parent's own record


@pytest.mark.parametrize(
    ("host_label", "expect"),
    [("Hostname", 'Hostname="node-1"'), ("hostname", 'hostname="node-1"'), (None, None)],
)
def test_host_label_option(host_label, expect):
    text = expo(blank(gpu_temp_c=40.0), options=RenderOptions(host_label=host_label))
    (line,) = lines_of(text, "DCGM_FI_DEV_GPU_TEMP")
    if expect is None:
        assert "ostname" not in line
    else:
        assert expect in line
        assert line.index(expect) < line.index("DCGM_FI_DRIVER_VERSION")


def test_empty_hostname_is_omitted():
    (line,) = lines_of(expo(blank(gpu_temp_c=40.0, hostname="")), "DCGM_FI_DEV_GPU_TEMP")
    assert "Hostname" not in line


def test_driver_label_only_when_selected():
    cs = parse_counters("DCGM_FI_DEV_GPU_TEMP, gauge, t\n")
    (line,) = lines_of(expo(blank(gpu_temp_c=40.0), counters=cs), "DCGM_FI_DEV_GPU_TEMP")
    assert "DCGM_FI_DRIVER_VERSION" not in line
    (line,) = lines_of(expo(blank(gpu_temp_c=40.0, driver_version=None)), "DCGM_FI_DEV_GPU_TEMP")
    assert "DCGM_FI_DRIVER_VERSION" not in line


def test_label_values_escaped():
    rec = blank(gpu_temp_c=40.0, model_name='Weird "GPU"\\ x\nmodel', hostname="h")
    (line,) = lines_of(expo(rec), "DCGM_FI_DEV_GPU_TEMP")
    assert 'modelName="Weird \\"GPU\\"\\\\ x\\nmodel"' in line
    assert escape_label_value('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    assert escape_help("a\\b\nc") == "a\\\\b\\nc"


def test_percent_in_label_values_is_harmless():
    (line,) = lines_of(expo(blank(gpu_temp_c=40.0, hostname="n%d%s")), "DCGM_FI_DEV_GPU_TEMP")
    assert 'Hostname="n%d%s"' in line


def test_replicas_of_one_container_are_one_series():
    a = [alloc("t", "p", "c", 0), alloc("t", "p", "c", 1)]
    assert len(lines_of(expo(blank(gpu_temp_c=40.0, allocations=a)), "DCGM_FI_DEV_GPU_TEMP")) == 1


# -- shared GPUs -----------------------------------------------------------------------------------
def shared_record(**kw) -> dict:
    return blank(
        allocations=[alloc("team-a", "pod-1", "main", 0), alloc("team-b", "pod-2", "main", 1)],
        processes=[
            proc(
                1,
                "team-a",
                "pod-1",
                "main",
                used_memory_bytes=2 * GiB,
                sm_util_ratio=0.30,
                mem_util_ratio=0.1,
            ),
            proc(2, "team-a", "pod-1", None, used_memory_bytes=GiB, sm_util_ratio=0.05, mem_util_ratio=0.02),
            proc(3, None, None, None, used_memory_bytes=MiB, sm_util_ratio=0.01),
        ],
        gpu_util_ratio=0.5,
        mem_copy_util_ratio=0.2,
        fb_used_bytes=4 * GiB,
        power_w=100.0,
        **kw,
    )


POD1 = 'container="main",namespace="team-a",pod="pod-1"'
POD2 = 'container="main",namespace="team-b",pod="pod-2"'


def test_shared_gpu_default_is_one_series_like_dcgm_exporter():
    """dcgm-exporter's default (no --kubernetes-virtual-gpus): one series per GPU, one pod (the last)
    on it, so sum(DCGM_FI_DEV_POWER_USAGE) counts a shared GPU once. Before: one copy per pod."""
    text = expo(shared_record())
    assert lines_of(text, "DCGM_FI_DEV_POWER_USAGE") == [
        f"DCGM_FI_DEV_POWER_USAGE{{{BASE},{POD2}}} 100.000000"
    ]
    assert lines_of(text, "DCGM_FI_DEV_GPU_UTIL") == [f"DCGM_FI_DEV_GPU_UTIL{{{BASE},{POD2}}} 50"]
    assert lines_of(text, "DCGM_FI_DEV_FB_USED") == [f"DCGM_FI_DEV_FB_USED{{{BASE},{POD2}}} 4096"]
    assert len(lines_of(text, "DCGM_FI_DEV_XID_ERRORS")) == 1


def test_shared_gpu_per_pod_share_under_gpupipe_names():
    text = expo(shared_record())
    assert lines_of(text, "gpupipe_pod_gpu_util_percent") == [
        f"gpupipe_pod_gpu_util_percent{{{BASE},{POD1}}} 35",
        f"gpupipe_pod_gpu_util_percent{{{BASE},{POD2}}} 0",
    ]
    assert lines_of(text, "gpupipe_pod_fb_used_mib") == [
        f"gpupipe_pod_fb_used_mib{{{BASE},{POD1}}} 3072",
        f"gpupipe_pod_fb_used_mib{{{BASE},{POD2}}} 0",
    ]
    assert [ln.rsplit(" ", 1)[1] for ln in lines_of(text, "gpupipe_pod_mem_copy_util_percent")] == ["12", "0"]
    assert "# TYPE gpupipe_pod_fb_used_mib gauge" in text
    off = expo(shared_record(), options=RenderOptions(split_shared=False))
    assert "gpupipe_pod_" not in off
    assert "gpupipe_pod_" not in expo(blank(gpu_util_ratio=0.5, allocations=[alloc("a", "b")]))


def test_shared_gpu_virtual_gpus_mode():
    """--kubernetes-virtual-gpus: a copy per allocation with vgpu; GPU_UTIL and FB_USED per process
    (device series + one per pod with pod_uid); other families repeat the device value."""
    text = expo(shared_record(), options=RenderOptions(virtual_gpus=True))
    v1, v2 = f'{POD1},vgpu="0"', f'{POD2},vgpu="1"'
    assert lines_of(text, "DCGM_FI_DEV_POWER_USAGE") == [
        f"DCGM_FI_DEV_POWER_USAGE{{{BASE},{v1}}} 100.000000",
        f"DCGM_FI_DEV_POWER_USAGE{{{BASE},{v2}}} 100.000000",
    ]
    assert lines_of(text, "DCGM_FI_DEV_GPU_UTIL") == [
        f"DCGM_FI_DEV_GPU_UTIL{{{BASE}}} 50",
        f'DCGM_FI_DEV_GPU_UTIL{{{BASE},{POD1},pod_uid="",vgpu="0"}} 35',
        f'DCGM_FI_DEV_GPU_UTIL{{{BASE},{POD2},pod_uid="",vgpu="1"}} 0',
    ]
    assert [ln.rsplit(" ", 1)[1] for ln in lines_of(text, "DCGM_FI_DEV_FB_USED")] == ["4096", "3072", "0"]
    assert [ln.rsplit(" ", 1)[1] for ln in lines_of(text, "DCGM_FI_DEV_MEM_COPY_UTIL")] == ["20", "20"]
    assert len(lines_of(text, "DCGM_FI_DEV_XID_ERRORS")) == 2
    rec = shared_record()
    rec["processes"] = []
    no_proc = expo(rec, options=RenderOptions(virtual_gpus=True))
    assert [ln.rsplit(" ", 1)[1] for ln in lines_of(no_proc, "DCGM_FI_DEV_FB_USED")] == ["4096", "4096"]


def test_shared_gpu_bad_process_value_dropped_and_counted():
    rec = shared_record()
    rec["processes"][0]["sm_util_ratio"] = math.nan
    s = SeriesStore(all_counters())
    text = expo(rec, store=s)
    assert [ln.rsplit(" ", 1)[1] for ln in lines_of(text, "gpupipe_pod_gpu_util_percent")] == ["0"]
    assert s.stats()["invalid"] == {("gpupipe_pod_gpu_util_percent", "nan"): 1}


# -- odd values ------------------------------------------------------------------------------------
def test_nan_inf_negative_dropped_and_counted():
    rec = blank(
        power_w=math.nan,
        gpu_util_ratio=-0.2,
        sm_active_ratio=math.inf,
        fb_used_bytes=-5,
        pcie_tx_bytes_per_s=-math.inf,
        gpu_temp_c=-4.4,  # a temperature may be negative
        sm_clock_mhz=1980,
    )
    s = SeriesStore(all_counters())
    text = expo(rec, store=s)
    for name in (
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
    ):
        assert lines_of(text, name) == []
        assert f"# HELP {name} " not in text  # no GPU has a line: no empty family either
    assert value_of(text, "DCGM_FI_DEV_GPU_TEMP") == "-4"
    assert value_of(text, "DCGM_FI_DEV_SM_CLOCK") == "1980"
    assert s.stats()["invalid"] == {
        ("DCGM_FI_DEV_POWER_USAGE", "nan"): 1,
        ("DCGM_FI_DEV_GPU_UTIL", "negative"): 1,
        ("DCGM_FI_PROF_SM_ACTIVE", "inf"): 1,
        ("DCGM_FI_DEV_FB_USED", "negative"): 1,
        ("DCGM_FI_PROF_PCIE_TX_BYTES", "inf"): 1,
    }
    assert 'gpupipe_metrics_invalid_values_total{field="DCGM_FI_DEV_POWER_USAGE",reason="nan"} 1' in text


def test_wrong_types_dropped_and_counted():
    s = SeriesStore(all_counters())
    text = expo(blank(sm_clock_mhz="fast", row_remap_failure=1, fb_used_bytes=1.5 * GiB), store=s)
    assert lines_of(text, "DCGM_FI_DEV_SM_CLOCK") == []
    assert value_of(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE") == "1"  # an int where a bool was expected
    assert value_of(text, "DCGM_FI_DEV_FB_USED") == "1536"  # a float where bytes (long) were expected
    assert s.stats()["invalid"] == {("DCGM_FI_DEV_SM_CLOCK", "invalid"): 1}


def test_ratios_above_one_are_no_reading():
    """The contract's bound (a ratio of a whole is within [0, 1]) holds where readings are printed."""
    text = expo(blank(gpu_util_ratio=1.37, tensor_active_ratio=1.2, power_w=300.0))
    assert lines_of(text, "DCGM_FI_DEV_GPU_UTIL") == []
    assert lines_of(text, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") == []
    assert value_of(text, "DCGM_FI_DEV_POWER_USAGE") == "300.000000"


def test_gpu_lost_sample_shows_only_xid_and_age():
    text = expo(blank(gpu_lost=True, last_xid=79), counters=default_counters())
    dcgm = [ln for ln in text.splitlines() if ln.startswith("DCGM_")]
    assert dcgm == [f'DCGM_FI_DEV_XID_ERRORS{{{BASE},err_code="79",err_msg="GPU has fallen off the bus"}} 79']
    assert len(lines_of(text, "gpupipe_sample_age_seconds")) == 1


def test_units_end_to_end():
    rec = blank(
        gpu_util_ratio=0.57,
        fb_used_bytes=40 * GiB + 123,
        fb_total_bytes=81559 * MiB,
        power_w=612.5,
        power_limit_w=700.0,
        total_energy_mj=123456789012,
        sm_clock_mhz=1980,
        gpu_temp_c=61.4,
        pcie_rx_bytes_per_s=3.4e9,
        nvlink_tx_bytes_per_s=5e10,
        dram_active_ratio=0.5,
        retired_pages_pending=True,
        row_remap_pending=False,
        ecc_dbe_volatile_total=2,
        clock_event_reasons=0x44,
    )
    text = expo(rec)
    expected = {
        "DCGM_FI_DEV_GPU_UTIL": "57",
        "DCGM_FI_DEV_FB_USED": "40960",
        "DCGM_FI_DEV_FB_TOTAL": "81559",
        "DCGM_FI_DEV_POWER_USAGE": "612.500000",
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": "700.000000",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "123456789012",
        "DCGM_FI_DEV_SM_CLOCK": "1980",
        "DCGM_FI_DEV_GPU_TEMP": "61",
        "DCGM_FI_PROF_PCIE_RX_BYTES": "3400000000",
        "DCGM_FI_PROF_NVLINK_TX_BYTES": "50000000000",
        "DCGM_FI_PROF_DRAM_ACTIVE": "0.500000",
        "DCGM_FI_DEV_RETIRED_PENDING": "1",
        "DCGM_FI_DEV_ROW_REMAP_PENDING": "0",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "2",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "68",
        "DCGM_FI_DEV_XID_ERRORS": "0",
    }
    for name, value in expected.items():
        assert value_of(text, name) == value, name
    assert lines_of(text, "DCGM_FI_DEV_VGPU_LICENSE_STATUS") == []  # null: no line


def test_fast_path_matches_reference_path():
    """For good values the fast path and the reference path print the same bytes."""
    r = Renderer(all_counters())
    rng = random.Random(5)
    view = r.view(blank())
    for _ in range(200):
        rec = blank()
        for src, kind, _signed, _fi, _name, _dcgm in r._plan:
            roll = rng.random()
            if roll < 0.1:
                rec[src] = None
            elif kind in (0,):
                rec[src] = rng.randrange(0, 1 << 40)
            elif kind == 5:
                rec[src] = rng.random() < 0.5
            elif kind == 3:
                rec[src] = rng.randrange(0, 1 << 38)
            else:
                hi = reading_max(src) or (1e10 if kind == 1 else 2)  # good values stay within bounds
                rec[src] = rng.random() * hi
        fast = r._render_fast(rec, view)
        assert fast == r._render_checked(rec, view, {})


def test_default_counters_render_every_default_family():
    rec = blank(
        **{
            s.spec.source: 1
            for s in default_counters().metrics
            if s.spec.source and s.spec.source not in ("last_xid",)
        }
    )
    rec["row_remap_failure"] = False
    for k in ("gpu_util_ratio", "mem_copy_util_ratio", "enc_util_ratio", "dec_util_ratio", "power_w"):
        rec[k] = 0.5
    text = expo(rec, counters=default_counters())
    for c in default_counters().metrics:
        if c.name != "DCGM_EXP_XID_ERRORS_TOTAL":
            assert len(lines_of(text, c.name)) == 1, c.name


def test_store_identity_matches_renderer_identity():
    """store.py inlines Renderer.identity for speed: both must stay the same tuple."""
    for counters in (all_counters(), parse_counters("DCGM_FI_DEV_GPU_TEMP, gauge, t\n")):
        s = SeriesStore(counters)
        rec = blank(allocations=[alloc("a", "b")])
        s.apply_sample(rec, 0, NOW)
        assert s._gpus[UUID].ident == s.renderer.identity(rec)


def test_nvlink_error_totals_from_dcgm_exporters_csv_rows():
    # dcgm-exporter's CSV rows for NVLink's error totals (commented out in its default file): a user
    # who enables them gets the node agent's NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL sums, as counters.
    rows = (
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, counter, "
        "Total number of NVLink flow-control CRC errors.\n"
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, counter, Total number of NVLink data CRC errors.\n"
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,   counter, Total number of NVLink retries.\n"
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, counter, Total number of NVLink recovery errors.\n"
    )
    cs = parse_counters(rows)
    assert not cs.unsupported
    rec = blank(
        nvlink_crc_flit_errors_total=7,
        nvlink_crc_data_errors_total=0,
        nvlink_replay_errors_total=12,
        nvlink_recovery_errors_total=None,  # not answered: no line, never 0
    )
    text = expo(rec, counters=cs)
    assert "# TYPE DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL counter" in text
    assert value_of(text, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL") == "7"
    assert value_of(text, "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL") == "0"
    assert value_of(text, "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL") == "12"
    assert lines_of(text, "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL") == []


def test_power_smoothing_where_supported_and_no_series_elsewhere():
    smoothing = blank(
        power_smoothing_enabled=True,
        power_smoothing_profile=2,
        power_smoothing_tmp_ceiling_w=1200.0,
        power_smoothing_tmp_floor_w=700.0,
        power_smoothing_lifetime_remaining_ratio=0.93,
    )
    text = expo(smoothing)
    assert value_of(text, "DCGM_FI_DEV_PWR_SMOOTHING_ENABLED") == "1"
    assert value_of(text, "DCGM_FI_DEV_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE") == "2"
    assert value_of(text, "DCGM_FI_DEV_PWR_SMOOTHING_APPLIED_TMP_CEIL") == "1200.000000"
    assert value_of(text, "DCGM_FI_DEV_PWR_SMOOTHING_APPLIED_TMP_FLOOR") == "700.000000"
    assert value_of(text, "DCGM_FI_DEV_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING") == "93"
    # a GPU or driver without power smoothing (null fields): no series at all, not a 0
    assert not [ln for ln in expo(blank()).splitlines() if "PWR_SMOOTHING" in ln and not ln.startswith("#")]
