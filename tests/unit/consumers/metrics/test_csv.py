"""gpupipe_consumers.metrics.collectors_csv: dcgm-exporter's counters CSV format (pure)."""

from __future__ import annotations

import logging

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.metrics.collectors_csv import (
    CountersError,
    all_counters,
    default_counters,
    default_counters_text,
    load_counters,
    parse_counters,
)
from gpupipe_consumers.metrics.fields import FIELDS, Kind

# Written in the shape of dcgm-exporter's etc/default-counters.csv: comments, aligned columns,
# a space before a comma, commented-out rows, a label row, and rows GpuSample cannot serve.
STOCK_STYLE = """\
# Format
# If line starts with a '#' it is considered a comment
# DCGM FIELD, Prometheus metric type, help message

# Clocks
DCGM_FI_DEV_SM_CLOCK,  gauge, SM clock frequency (in MHz).

# Utilization (the sample period varies depending on the product)
DCGM_FI_DEV_GPU_UTIL,      gauge, GPU utilization (in %).
DCGM_FI_DEV_DEC_UTIL ,     gauge, Decoder utilization (in %).

   # an indented comment
# DCGM_FI_DEV_POWER_VIOLATION,       counter, Throttling duration due to power constraints (in ns).
DCGM_FI_DEV_SYNC_BOOST_VIOLATION,  counter, Throttling duration due to sync-boost constraints (in ns).
DCGM_EXP_GPU_HEALTH_STATUS,  gauge,   Current DCGM-reported GPU health status.

# Static configuration information. These appear as labels on the other metrics
DCGM_FI_DRIVER_VERSION,        label, Driver Version
DCGM_FI_DEV_VBIOS_VERSION,     label, VBIOS version of the device
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, gauge, Ratio of cycles the tensor (HMMA) pipe is active.
"""


def test_stock_style_file():
    cs = parse_counters(STOCK_STYLE, source="stock")
    assert cs.names == (
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_EXP_GPU_HEALTH_STATUS",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    )
    assert [c.name for c in cs.labels] == ["DCGM_FI_DRIVER_VERSION", "DCGM_FI_DEV_VBIOS_VERSION"]
    assert cs.has_label("DCGM_FI_DRIVER_VERSION")
    assert cs.skipped == ((14, "DCGM_FI_DEV_SYNC_BOOST_VIOLATION"),)
    dec = cs.metrics[2]
    assert (dec.prom_type, dec.help, dec.line) == ("gauge", "Decoder utilization (in %).", 10)


def test_unsupported_fields_listed_once(caplog):
    with caplog.at_level(logging.WARNING, logger="gpupipe.metrics"):
        parse_counters(STOCK_STYLE, source="stock")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "DCGM_FI_DEV_SYNC_BOOST_VIOLATION (line 14: not carried by GpuSample)" in caplog.text
    assert "1 field(s) cannot be served" in caplog.text


def test_strict_rejects_unsupported_fields():
    with pytest.raises(CountersError) as exc:
        parse_counters(STOCK_STYLE, source="stock", strict=True)
    assert "line 14: DCGM_FI_DEV_SYNC_BOOST_VIOLATION: not carried by GpuSample" in str(exc.value)


def test_untyped_histogram_duplicates_and_odd_rows_are_accepted():
    """dcgm-exporter accepts these (<= 4.8.2: histogram/summary; 4.8.3: untyped; duplicates; any DCGM
    field): before, each one stopped the service at startup."""
    text = """\
DCGM_FI_DEV_GPU_TEMP, histogram, as 4.8.2 allowed
DCGM_FI_DEV_SM_CLOCK, untyped, as 4.8.3 allows
DCGM_FI_DEV_POWER_USAGE, gauge, Power draw (in W).
DCGM_FI_DEV_POWER_USAGE, gauge, again
DCGM_FI_DEV_GPU_UTIL, label, a number as a label
DCGM_FI_DRIVER_VERSION, gauge, a string as a gauge
DCGM_FI_DEV_FAN_SPEED, gauge, Fan speed
DCGM_FI_DEV_MEM_CLOCK, summary, Memory clock
"""
    cs = parse_counters(text, source="odd.csv")
    assert [(c.name, c.prom_type) for c in cs.metrics] == [
        ("DCGM_FI_DEV_GPU_TEMP", "untyped"),
        ("DCGM_FI_DEV_SM_CLOCK", "untyped"),
        ("DCGM_FI_DEV_POWER_USAGE", "gauge"),
        ("DCGM_FI_DEV_MEM_CLOCK", "untyped"),
    ]
    assert cs.metrics[2].help == "Power draw (in W)."  # the first of two duplicate rows
    assert [(u.name, u.reason) for u in cs.unsupported] == [
        ("DCGM_FI_DEV_GPU_UTIL", "a number cannot be a label"),
        ("DCGM_FI_DRIVER_VERSION", "a string field cannot be a gauge"),
        ("DCGM_FI_DEV_FAN_SPEED", "not carried by GpuSample"),
    ]
    assert any("duplicates line 3" in n for n in cs.notes)


def test_every_error_listed_at_once():
    text = """\
GPU_TEMPP, gauge, not a DCGM name
DCGM_FI_DEV_GPU_TEMP, gaugee, bad type
DCGM_FI_DEV_SM_CLOCK
, gauge, no name
"""
    with pytest.raises(CountersError) as exc:
        parse_counters(text, source="bad.csv")
    msg = str(exc.value)
    assert msg.startswith("counters file bad.csv: ")
    for part in (
        "line 1: GPU_TEMPP: unknown field",
        "line 2: DCGM_FI_DEV_GPU_TEMP: unsupported type 'gaugee'",
        "line 3: expected 'FIELD, type, help'",
        "line 4: empty field name",
    ):
        assert part in msg
    assert isinstance(exc.value, ConfigError)


def test_quoted_help_loses_its_quotes_as_in_go_csv():
    cs = parse_counters('DCGM_FI_DEV_GPU_TEMP, gauge, "GPU temperature, in C"\n')
    assert cs.metrics[0].help == "GPU temperature, in C"


def test_help_with_commas_and_type_case():
    cs = parse_counters("DCGM_FI_DEV_GPU_TEMP, GAUGE, GPU temperature, in C, as DCGM reads it\n")
    (c,) = cs.metrics
    assert (c.prom_type, c.help) == ("gauge", "GPU temperature, in C, as DCGM reads it")


def test_csv_type_overrides_default():
    cs = parse_counters("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL, counter, Total NVLink.\n")
    assert cs.metrics[0].prom_type == "counter"
    assert cs.metrics[0].spec.prom_type == "gauge"


T = "DCGM_FI_DEV_GPU_TEMP"
#: Rows dcgm-exporter 4.8.2 reads from each text (its ReadCSVFile + ExtractCounters: Go encoding/csv
#: with Comment '#', strings.Trim(cell, " "), 3 cells, case-sensitive types), as printed by a
#: throwaway Go 1.26.8 program doing exactly that (dcgm-exporter 4.8.2 builds with Go 1.26.2).
GO_READS = [
    (f"{T}, gauge, GPU temperature (in C).\n", [(T, "gauge", "GPU temperature (in C).")]),
    (f'{T}, gauge,"GPU temperature, in C"\n', [(T, "gauge", "GPU temperature, in C")]),
    (f"{T}, gauge,\n", [(T, "gauge", "")]),  # was: gpupipe's HELP
    (f'{T}, gauge," GPU temp "\n', [(T, "gauge", "GPU temp")]),  # was: ' GPU temp '
    (f'{T}, gauge,"say ""hi"""\n', [(T, "gauge", 'say "hi"')]),
    (f"{T}, gauge, temp # note\n", [(T, "gauge", "temp # note")]),
    (
        f"{T}, gauge, t\r\nDCGM_FI_DEV_POWER_USAGE, gauge, p\r\n",
        [(T, "gauge", "t"), ("DCGM_FI_DEV_POWER_USAGE", "gauge", "p")],
    ),
    (f"\n\n# c\n{T} , gauge , t \n", [(T, "gauge", "t")]),
    (f"{T},gauge,t\n#{T},gauge,u\n", [(T, "gauge", "t")]),
]
#: Texts dcgm-exporter refuses at start (Go's error) that gpupipe reads, with what it reads.
GO_REFUSES = [
    (f'{T}, gauge, "GPU temperature, in C"\n', 'bare " in non-quoted-field', "GPU temperature, in C"),
    (f"{T}, gauge, GPU temperature, in C\n", "4 fields", "GPU temperature, in C"),
    (f"  # {T}, gauge, x\n{T}, gauge, t\n", 'unknown field "# DCGM_FI_DEV_GPU_TEMP"', "t"),
    (f"{T},\tgauge,\tGPU temp\n", 'type "\\tgauge"', "GPU temp"),
    (f"{T}, Gauge, t\n", 'type "Gauge"', "t"),
    (f'{T}, gauge,"x" \n', 'extraneous or missing " in quoted-field', "x"),
    (f"{T}, gauge, t\n   \n", "wrong number of fields", "t"),
    (f'"{T}", "gauge", t\n', 'bare " in non-quoted-field', "t"),
]


@pytest.mark.parametrize(("text", "rows"), GO_READS)
def test_every_file_go_reads_gives_the_same_rows(text: str, rows: list) -> None:
    cs = parse_counters(text)
    assert [(c.name, c.prom_type, c.help) for c in cs.metrics] == rows


@pytest.mark.parametrize(("text", "go_error", "help_"), GO_REFUSES)
def test_files_dcgm_exporter_refuses_are_read_leniently(text: str, go_error: str, help_: str) -> None:
    (c,) = parse_counters(text).metrics
    assert (c.name, c.prom_type, c.help) == (T, "gauge", help_), go_error


def test_a_quoted_field_over_two_lines_is_an_error_here() -> None:
    """Go reads it (a HELP with a line feed, which dcgm-exporter 4.8.2 then prints raw, breaking its
    exposition); we stop at start."""
    with pytest.raises(CountersError):
        parse_counters(f'{T}, gauge,"line1\nline2"\n')


def test_empty_help_renders_an_empty_help_line() -> None:
    from gpupipe_consumers.metrics.render import Renderer

    (fam,) = Renderer(parse_counters(f"{T}, gauge,\n"), None).families[:1]
    assert fam.header.startswith(f"# HELP {T} \n# TYPE {T} gauge\n")


def test_empty_file():
    cs = parse_counters("# nothing\n\n")
    assert cs.metrics == () and cs.labels == ()


def test_default_selection():
    cs = default_counters()
    names = set(cs.names)
    upstream_active = {
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
    }
    profiling_extras = {
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
    }
    for_rules = {  # read by deploy/prometheus/gpupipe-alerts.rules.yml
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION",
    }
    assert names == upstream_active | profiling_extras | for_rules | {"DCGM_EXP_XID_ERRORS_TOTAL"}
    assert [c.name for c in cs.labels] == ["DCGM_FI_DRIVER_VERSION"]
    assert cs.skipped == ()
    # the HELP/TYPE of the shipped file equal the field table's (one source of truth, two copies)
    for c in cs.metrics:
        assert (c.prom_type, c.help) == (c.spec.prom_type, c.spec.help), c.name


def test_default_file_comments_out_every_other_field_we_serve():
    text = default_counters_text()
    for spec in FIELDS:
        assert spec.name in text or spec.name in (
            "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            "DCGM_FI_DEV_GPU_RECOVERY_ACTION",
            "DCGM_FI_DEV_UUID",
            "DCGM_FI_DEV_NAME",
            "DCGM_FI_DEV_PCI_BUSID",
        ), f"{spec.name} is missing from the shipped default CSV"


def test_load_counters(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("DCGM_FI_DEV_GPU_TEMP, gauge, t\n")
    assert load_counters(p).names == ("DCGM_FI_DEV_GPU_TEMP",)
    assert load_counters(None).names == default_counters().names
    with pytest.raises(CountersError, match="cannot read counters file"):
        load_counters(tmp_path / "missing.csv")


def test_all_counters_covers_every_field():
    cs = all_counters()
    assert {c.name for c in cs.metrics} == {f.name for f in FIELDS if f.kind is not Kind.LABEL}
    assert [c.name for c in cs.labels] == ["DCGM_FI_DRIVER_VERSION"]
    assert all(c.spec.kind is not Kind.LABEL for c in cs.metrics)
