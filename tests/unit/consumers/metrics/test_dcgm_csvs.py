"""Every row of dcgm-exporter's shipped counters CSVs loads, active and commented rows alike.

Fixtures: tests/fixtures/metrics/dcgm-exporter/ (verbatim copies; sources in its README.md).
Before this change the 1.x file and any file with one field outside gpupipe's table stopped the
service at startup, and the DCGM_EXP_* rows were skipped with a log line.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from gpupipe_consumers.metrics.collectors_csv import parse_counters
from gpupipe_consumers.metrics.fields import LEGACY, lookup
from gpupipe_consumers.metrics.store import SeriesStore
from tests.paths import TESTS

FIX = TESTS / "fixtures" / "metrics" / "dcgm-exporter"
CSVS = sorted(FIX.glob("*.csv"))
ROW = re.compile(r"^#\s*((?:DCGM_|dcgm_)\w+\s*,.*)$")


def uncommented(text: str) -> str:
    """Every row of the file, the commented-out ones enabled too."""
    return "\n".join(m.group(1) if (m := ROW.match(ln.strip())) else ln for ln in text.splitlines()) + "\n"


def rows(text: str) -> list[str]:
    return [
        ln.split(",", 1)[0].strip()
        for ln in text.splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]


@pytest.mark.parametrize("path", CSVS, ids=lambda p: p.name)
@pytest.mark.parametrize("enable_all", [False, True], ids=["as-shipped", "every-row"])
def test_shipped_csv_loads_and_every_row_is_accounted_for(path: Path, enable_all: bool, caplog) -> None:
    text = path.read_text()
    if enable_all:
        text = uncommented(text)
    with caplog.at_level(logging.WARNING, logger="gpupipe.metrics"):
        cs = parse_counters(text, source=path.name)
    names = rows(text)
    assert names, "the fixture has rows"
    served = {c.name for c in (*cs.metrics, *cs.labels)}
    left_out = {u.name for u in cs.unsupported}
    for n in names:
        assert n in served or n in left_out, n
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 1  # listed once
    for u in cs.unsupported:  # only fields we really lack are left out
        assert lookup(u.name) is None or u.reason != "not carried by GpuSample"


def test_every_row_files_serve_the_exporter_families() -> None:
    cs = parse_counters(uncommented((FIX / "default-counters-4.8.3.csv").read_text()))
    served = set(cs.names)
    for name in (
        "DCGM_EXP_XID_ERRORS_COUNT",
        "DCGM_EXP_XID_ERRORS_TOTAL",
        "DCGM_EXP_CLOCK_EVENTS_COUNT",
        "DCGM_EXP_CLOCK_EVENTS_TOTAL",
        "DCGM_EXP_GPU_HEALTH_STATUS",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    ):
        assert name in served, name
    assert {c.name for c in cs.labels} >= {
        "DCGM_FI_DRIVER_VERSION",
        "DCGM_FI_DEV_SERIAL",
        "DCGM_FI_DEV_VBIOS_VERSION",
        "DCGM_FI_NVML_VERSION",
        "DCGM_FI_DEV_BRAND",
    }
    left_out = {u.name for u in cs.unsupported}
    assert "DCGM_EXP_P2P_STATUS" in left_out and "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0" in left_out
    # the node agent reads NVLink's error totals (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL) now
    assert {
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    } <= served


def test_1x_file_keeps_its_metric_names() -> None:
    cs = parse_counters((FIX / "1.x-compatibility-metrics.csv").read_text())
    assert cs.names[:2] == ("dcgm_sm_clock", "dcgm_memory_clock")
    assert cs.metrics[0].spec.name == "DCGM_FI_DEV_SM_CLOCK"
    assert any("dcgm_fi_prof_pcie_tx_bytes" in n and "duplicates" in n for n in cs.notes)
    for c in cs.metrics:
        assert c.name in LEGACY


def test_unsupported_fields_info_metric() -> None:
    cs = parse_counters("DCGM_FI_DEV_FAN_SPEED, gauge, Fan\nDCGM_FI_DEV_GPU_TEMP, gauge, t\n", source="f.csv")
    text = SeriesStore(cs).render(0.0).decode()
    assert "# TYPE gpupipe_metrics_unsupported_fields gauge" in text
    assert (
        'gpupipe_metrics_unsupported_fields{field="DCGM_FI_DEV_FAN_SPEED",line="1",'
        'reason="not carried by GpuSample"} 1'
    ) in text
    assert "gpupipe_metrics_unsupported_fields" not in SeriesStore(parse_counters("")).render(0.0).decode()


def test_1x_file_with_old_namespace_labels() -> None:
    from gpupipe_consumers.metrics.render import RenderOptions
    from tests.unit.consumers.metrics.test_store import T_MS, alloc, blank

    cs = parse_counters((FIX / "1.x-compatibility-metrics.csv").read_text())
    store = SeriesStore(cs, options=RenderOptions(old_namespace=True))
    store.apply_sample(blank(allocations=[alloc("ns", "p", "c")]), 0, T_MS / 1000)
    text = store.render(T_MS / 1000).decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("dcgm_gpu_temp{")]
    assert line == (
        'dcgm_gpu_temp{gpu="0",uuid="GPU-0",pci_bus_id="00000000:3B:00.0",device="nvidia0",'
        'modelName="NVIDIA H200",Hostname="node-1",container_name="c",pod_name="p",pod_namespace="ns"} 50'
    )
    assert "# TYPE dcgm_xid_errors gauge" in text


def test_shipped_default_has_dcgm_exporters_type_and_help_for_every_row_it_has() -> None:
    """gpupipe's default CSV: a row dcgm-exporter's 4.8.3 files have (active, else commented) has the
    same TYPE and HELP there; the few rows it has no row for carry gpupipe's HELP (docs/metrics.md)."""
    from gpupipe_consumers.metrics.collectors_csv import default_counters

    upstream: dict[str, tuple[str, str]] = {}
    for name in ("default-counters-4.8.3.csv", "dcp-metrics-included-4.8.3.csv"):
        text = (FIX / name).read_text()
        for cs in (parse_counters(text), parse_counters(uncommented(text))):  # active rows first
            for c in (*cs.metrics, *cs.labels):
                upstream.setdefault(c.name, (c.prom_type, c.help))
    ours = default_counters()
    not_upstream = set()
    for c in (*ours.metrics, *ours.labels):
        if c.name in upstream:
            assert (c.prom_type, c.help) == upstream[c.name], c.name
        else:
            not_upstream.add(c.name)
    assert not_upstream == {
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION",
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
    }
