"""--dialect: dcgm-exporter 4.8 names unchanged, 4.9 base-unit names and values, 4.10's renames,
several generations at once (pure).

The rows checked are those of dcgm-exporter's own default counters CSV (the 4.8.3 file in
``tests/fixtures/metrics/dcgm-exporter/``, see its README): every active row of it must render
under its 4.9 and its 4.10 name, with that generation's unit, for one known sample. The expected
names and values are written out here, independently of ``consumers/metrics/dialect.py``.
"""

from __future__ import annotations

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.metrics import dialect
from gpupipe_consumers.metrics.collectors_csv import (
    default_counters,
    in_dialect,
    load_counters,
    parse_counters,
)
from gpupipe_consumers.metrics.command import config_from_args
from gpupipe_consumers.metrics.store import SeriesStore
from tests.paths import TESTS
from tests.unit.consumers.metrics.test_dcgm_flags import parse
from tests.unit.consumers.metrics.test_render import NOW, GiB, MiB, blank, lines_of

CSV_483 = TESTS / "fixtures/metrics/dcgm-exporter/default-counters-4.8.3.csv"

#: One known sample (GpuSample units: MHz, mJ, ratios 0-1, bytes, KiB).
SAMPLE = {
    "sm_clock_mhz": 1980,
    "mem_clock_mhz": 2619,
    "memory_temp_c": 45.0,
    "gpu_temp_c": 61.0,
    "power_w": 312.5,
    "total_energy_mj": 123_456_789,
    "pcie_replay_count": 3,
    "gpu_util_ratio": 0.87,
    "mem_copy_util_ratio": 0.42,
    "enc_util_ratio": 0.0,
    "dec_util_ratio": 0.05,
    "last_xid": 0,
    "fb_free_bytes": 100 * GiB,
    "fb_used_bytes": 40 * GiB + 5 * MiB,
    "fb_reserved_bytes": 512 * MiB,
    "nvlink_bandwidth_total_kib": 2048,
    "vgpu_license_status": 0,
    "remapped_rows_uncorrectable": 1,
    "remapped_rows_correctable": 2,
    "row_remap_failure": False,
    "gr_engine_active_ratio": 0.5,
    "tensor_active_ratio": 0.25,
    "dram_active_ratio": 0.125,
    "pcie_tx_bytes_per_s": 1_000_000.0,
    "pcie_rx_bytes_per_s": 2_000_000.0,
}

#: 4.8 name: (its 4.8 value, the 4.9 name, the 4.9 value) for every active row of the 4.8.3 CSV.
EXPECTED = {
    "DCGM_FI_DEV_SM_CLOCK": ("1980", "DCGM_FI_DEV_SM_CLOCK_HERTZ", "1980000000"),
    "DCGM_FI_DEV_MEM_CLOCK": ("2619", "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", "2619000000"),
    "DCGM_FI_DEV_MEMORY_TEMP": ("45", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS", "45"),
    "DCGM_FI_DEV_GPU_TEMP": ("61", "DCGM_FI_DEV_GPU_TEMP_CELSIUS", "61"),
    "DCGM_FI_DEV_POWER_USAGE": ("312.500000", "DCGM_FI_DEV_BOARD_POWER_WATTS", "312.500000"),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (
        "123456789",
        "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL",
        "123456",
    ),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("3", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL", "3"),
    "DCGM_FI_DEV_GPU_UTIL": ("87", "DCGM_FI_DEV_GPU_UTIL_RATIO", "0.870000"),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("42", "DCGM_FI_DEV_MEMORY_UTIL_RATIO", "0.420000"),
    "DCGM_FI_DEV_ENC_UTIL": ("0", "DCGM_FI_DEV_ENC_UTIL_RATIO", "0.000000"),
    "DCGM_FI_DEV_DEC_UTIL": ("5", "DCGM_FI_DEV_DEC_UTIL_RATIO", "0.050000"),
    "DCGM_FI_DEV_XID_ERRORS": ("0", "DCGM_FI_DEV_XID_ERROR", "0"),
    "DCGM_FI_DEV_FB_FREE": ("102400", "DCGM_FI_DEV_FB_FREE_BYTES", str(100 * GiB)),
    "DCGM_FI_DEV_FB_USED": ("40965", "DCGM_FI_DEV_FB_USED_BYTES", str(40 * GiB + 5 * MiB)),
    "DCGM_FI_DEV_FB_RESERVED": ("512", "DCGM_FI_DEV_FB_RESERVED_BYTES", str(512 * MiB)),
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": (
        "2048",
        "DCGM_FI_DEV_NVLINK_THROUGHPUT_BYTES_PER_SECOND",
        str(2048 * 1024),
    ),
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": ("0", "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "0"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("1", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL", "1"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("2", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL", "2"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("0", "DCGM_FI_DEV_ROW_REMAP_FAILED", "0"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("0.500000", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", "0.500000"),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("0.250000", "DCGM_FI_PROF_TENSOR_UTIL_RATIO", "0.250000"),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("0.125000", "DCGM_FI_PROF_DRAM_UTIL_RATIO", "0.125000"),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("1000000", "DCGM_FI_PROF_PCIE_TX_BYTES", "1000000"),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("2000000", "DCGM_FI_PROF_PCIE_RX_BYTES", "2000000"),
}


#: The rows 4.10.0 renamed again (4.8 name -> 4.10 name; the value is the same B/s rate).
RENAMED_410 = {
    "DCGM_FI_PROF_PCIE_TX_BYTES": "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND",
}

#: 4.8 name: (the 4.10 name, the 4.10 value) for every active row of the 4.8.3 CSV.
EXPECTED_410 = {old: (RENAMED_410.get(old, new), v49) for old, (_v48, new, v49) in EXPECTED.items()}


def scrape(counters, **kw) -> str:
    s = SeriesStore(counters)
    s.apply_sample(blank(**{**SAMPLE, **kw}), 0, NOW)
    return s.render(NOW).decode()


def value(text: str, name: str) -> str:
    (ln,) = lines_of(text, name)
    return ln.rsplit(" ", 1)[1]


def test_expected_covers_every_active_row_of_dcgm_exporters_default_csv():
    cs = load_counters(CSV_483)
    assert set(cs.names) == set(EXPECTED)
    assert [c.name for c in cs.labels] == ["DCGM_FI_DRIVER_VERSION"]


def test_dcgm_48_is_todays_output_byte_for_byte():
    cs = load_counters(CSV_483)
    assert in_dialect(cs, "dcgm-4.8") is cs
    text = scrape(cs)
    for old, (v48, _new, _v49) in EXPECTED.items():
        assert value(text, old) == v48, old
    assert 'DCGM_FI_DRIVER_VERSION="570.124.06"' in text
    assert "DCGM_FI_SYSTEM_DRIVER_VERSION" not in text


def test_dcgm_49_every_default_row_under_its_49_name_and_unit():
    text = scrape(in_dialect(load_counters(CSV_483), "dcgm-4.9"))
    for old, (_v48, new, v49) in EXPECTED.items():
        assert value(text, new) == v49, new
        if old != new:
            assert not lines_of(text, old), old
    assert 'DCGM_FI_SYSTEM_DRIVER_VERSION="570.124.06"' in text
    assert 'DCGM_FI_DRIVER_VERSION="' not in text


def test_dcgm_49_help_names_the_new_unit_and_keeps_type():
    text = scrape(in_dialect(load_counters(CSV_483), "dcgm-4.9"))
    assert "# HELP DCGM_FI_DEV_SM_CLOCK_HERTZ SM clock frequency (in Hz).\n" in text
    assert "# TYPE DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL counter\n" in text
    assert "# HELP DCGM_FI_DEV_FB_USED_BYTES Framebuffer memory used (in bytes).\n" in text
    # a rename without a unit change keeps the file's HELP
    assert "# HELP DCGM_FI_DEV_GPU_TEMP_CELSIUS GPU temperature (in C).\n" in text


def test_renames_and_unit_changes_count_as_the_release_notes():
    # 4.9.0's release notes: 23 default and profiling fields renamed, 11 with a unit change, and
    # the driver-version label renamed. gpupipe's table also renames SM_OCCUPANCY and FP64/32/16.
    # 4.10.0's: the four PCIe/NVLink profiling rates renamed, no unit change.
    metrics = [r for r in dialect.RENAMES if r.old != "DCGM_FI_DRIVER_VERSION" and r.since == "dcgm-4.9"]
    in_default = set(EXPECTED) | {"DCGM_FI_PROF_SM_ACTIVE"}
    assert len([r for r in metrics if r.old in in_default]) == 23
    assert len([r for r in metrics if r.unit_change]) == 11
    in_410 = [r for r in dialect.RENAMES if r.since == "dcgm-4.10"]
    assert len(in_410) == 4 and not any(r.unit_change for r in in_410)


def test_dcgm_410_is_49_plus_the_pcie_nvlink_rates_renamed_with_their_value():
    text = scrape(in_dialect(load_counters(CSV_483), "dcgm-4.10"))
    for old, (new, v410) in EXPECTED_410.items():
        assert value(text, new) == v410, new
        if old != new:
            assert not lines_of(text, old), old
    assert value(text, "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND") == "1000000"  # B/s, as under 4.8
    assert "# TYPE DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND gauge\n" in text
    assert "# HELP DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND The rate of data received" in text
    assert 'DCGM_FI_SYSTEM_DRIVER_VERSION="570.124.06"' in text


def test_dcgm_410_renames_the_nvlink_rates_of_the_shipped_default():
    text = scrape(
        in_dialect(default_counters(), "dcgm-4.10"), nvlink_tx_bytes_per_s=3e9, nvlink_rx_bytes_per_s=4e9
    )
    assert value(text, "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND") == "3000000000"
    assert value(text, "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND") == "4000000000"
    assert not lines_of(text, "DCGM_FI_PROF_NVLINK_TX_BYTES")


def test_both_serves_each_renamed_series_under_every_generations_name():
    text = scrape(in_dialect(load_counters(CSV_483), "both"))
    for old, (v48, new, v49) in EXPECTED.items():
        assert value(text, old) == v48, old
        assert value(text, new) == v49, new
        new410, v410 = EXPECTED_410[old]
        assert value(text, new410) == v410, new410
    line = lines_of(text, "DCGM_FI_DEV_GPU_TEMP")[0]
    assert 'DCGM_FI_DRIVER_VERSION="570.124.06"' in line
    assert 'DCGM_FI_SYSTEM_DRIVER_VERSION="570.124.06"' in line


def test_a_comma_list_serves_each_listed_generation_and_no_other():
    text = scrape(in_dialect(load_counters(CSV_483), "dcgm-4.10, dcgm-4.9"))
    assert value(text, "DCGM_FI_PROF_PCIE_TX_BYTES") == "1000000"  # 4.9's name
    assert value(text, "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND") == "1000000"
    assert value(text, "DCGM_FI_DEV_SM_CLOCK_HERTZ") == "1980000000"
    assert not lines_of(text, "DCGM_FI_DEV_SM_CLOCK")  # 4.8 is not listed
    assert dialect.generations("dcgm-4.10,dcgm-4.9,dcgm-4.10") == ("dcgm-4.9", "dcgm-4.10")
    assert dialect.generations("both") == ("dcgm-4.8", "dcgm-4.10")


@pytest.mark.parametrize("which", [*dialect.DIALECTS, "dcgm-4.8,dcgm-4.9"])
def test_a_newer_counters_file_loads_as_it_is_in_any_dialect(which):
    csv = (
        "DCGM_FI_DEV_SM_CLOCK_HERTZ, gauge, SM clock frequency (in Hz).\n"
        "DCGM_FI_DEV_FB_USED_BYTES, gauge, Framebuffer memory used (in bytes).\n"
        "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND, gauge, PCIe TX (in B/s).\n"
        "DCGM_FI_SYSTEM_DRIVER_VERSION, label, Driver Version\n"
    )
    cs = parse_counters(csv, strict=True)
    text = scrape(in_dialect(cs, which))
    assert value(text, "DCGM_FI_DEV_SM_CLOCK_HERTZ") == "1980000000"
    assert value(text, "DCGM_FI_DEV_FB_USED_BYTES") == str(40 * GiB + 5 * MiB)
    assert value(text, "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND") == "1000000"
    assert "# HELP DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND PCIe TX (in B/s).\n" in text
    assert not lines_of(text, "DCGM_FI_DEV_SM_CLOCK")
    assert not lines_of(text, "DCGM_FI_PROF_PCIE_TX_BYTES")


def test_each_newer_name_derives_from_a_48_name():
    # a newer name renamed again would need its own chain: every generation's name is one step
    # from the 4.8 name, so in_dialect never meets a newer name to translate
    olds = {r.old for r in dialect.RENAMES}
    assert not olds & set(dialect.NEW_SPECS)
    assert len(olds) == len(dialect.RENAMES) == len(dialect.NEW_SPECS)
    assert {r.since for r in dialect.RENAMES} == {"dcgm-4.9", "dcgm-4.10"}
    assert all(r.origin in {"alias", "base", "ref", "rel"} for r in dialect.RENAMES)


def test_1x_names_are_left_alone():
    cs = parse_counters("dcgm_sm_clock, gauge, SM clock\n")
    assert in_dialect(cs, "dcgm-4.9").names == ("dcgm_sm_clock",)


def test_shipped_default_in_410_has_no_48_name_left_for_a_renamed_field():
    names = set(in_dialect(default_counters(), "dcgm-4.10").names)
    assert not names & set(dialect.BY_OLD)
    assert {"DCGM_FI_PROF_SM_UTIL_RATIO", "DCGM_FI_PROF_FP16_UTIL_RATIO"} <= names
    names49 = set(in_dialect(default_counters(), "dcgm-4.9").names)
    assert names49 - names == {
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
    }


@pytest.mark.parametrize(
    "kw",
    [
        {"sm_clock_mhz": None},
        {"sm_clock_mhz": -1},
        {"total_energy_mj": 1.5},
        {"gpu_util_ratio": float("nan")},
    ],
)
def test_odd_values_are_dropped_as_under_48(kw):
    text = scrape(in_dialect(load_counters(CSV_483), "dcgm-4.9"), **kw)
    (src,) = kw
    name = {
        "sm_clock_mhz": "DCGM_FI_DEV_SM_CLOCK_HERTZ",
        "total_energy_mj": "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL",
        "gpu_util_ratio": "DCGM_FI_DEV_GPU_UTIL_RATIO",
    }[src]
    if kw[src] == 1.5:  # a float energy is rounded on the checked path, as under 4.8
        assert value(text, name) == "0"
    else:
        assert not lines_of(text, name)
    assert value(text, "DCGM_FI_DEV_GPU_TEMP_CELSIUS") == "61"


def test_flag_and_env_twin():
    names = config_from_args(parse(["--dialect", "dcgm-4.9"])).counters.names
    assert "DCGM_FI_DEV_SM_CLOCK_HERTZ" in names
    names = config_from_args(parse([], {"GPUPIPE_DIALECT": "both"})).counters.names
    assert {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK_HERTZ"} <= set(names)
    names = config_from_args(parse(["--dialect", "dcgm-4.8,dcgm-4.10"])).counters.names
    assert {"DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND"} <= set(names)
    names = config_from_args(parse([])).counters.names
    assert "DCGM_FI_DEV_SM_CLOCK" in names
    assert "DCGM_FI_DEV_SM_CLOCK_HERTZ" not in names
    for bad in ("dcgm-5", "dcgm-4.8,", "dcgm-4.8,dcgm-5"):
        with pytest.raises(ConfigError, match="dialect"):
            config_from_args(parse(["--dialect", bad]))
    with pytest.raises(ConfigError, match="dialect"):
        config_from_args(parse([], {"GPUPIPE_DIALECT": "dcgm-5"}))
