"""gpupipe_consumers.metrics.fields and render.format_value: names, units, value text (pure)."""

from __future__ import annotations

import math
import re

import pytest

from gpupipe_consumers.metrics import fields
from gpupipe_consumers.metrics.fields import FIELDS, UNAVAILABLE, Kind
from gpupipe_consumers.metrics.render import InvalidValue, format_value
from gpupipe_schemas import catalog

MiB = 1 << 20


def _schema_fields() -> dict[str, dict]:
    return {f["name"]: f for f in catalog.current("GpuSample").raw["fields"]}


def test_names_unique_and_types_valid():
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names))
    for f in FIELDS:
        assert re.fullmatch(r"DCGM_(FI|EXP)_[A-Z0-9_]+", f.name), f.name
        assert f.prom_type in ("gauge", "counter", "label"), f.name
        assert (f.prom_type == "label") == (f.kind is Kind.LABEL), f.name
        assert f.help and "\n" not in f.help
        assert "," not in f.help, f"{f.name}: a comma in the help breaks dcgm-exporter's CSV parser"
    assert not set(names) & UNAVAILABLE


def test_sources_are_gpusample_fields():
    schema = _schema_fields()
    for f in FIELDS:
        if f.source is not None:
            assert f.source in schema, f"{f.name} reads unknown field {f.source}"
        if f.per_pod is not None:
            proc_fields = {x["name"] for x in schema["processes"]["type"]["items"]["fields"]}
            assert f.per_pod in proc_fields


def test_every_dcgm_field_named_in_the_schema_is_mapped():
    """Each GpuSample field whose doc names a DCGM field is served under that name."""
    schema = _schema_fields()
    served = {f.name: f for f in FIELDS}
    for name, fdef in schema.items():
        for dcgm in re.findall(r"DCGM_FI_[A-Z0-9_]+", fdef.get("doc", "")):
            assert dcgm in served, f"{name} mentions {dcgm}, which fields.py does not serve"
            assert served[dcgm].source == name, f"{dcgm} should read {name}"


@pytest.mark.parametrize(
    ("name", "kind", "prom_type"),
    [
        ("DCGM_FI_DEV_GPU_UTIL", Kind.PERCENT, "gauge"),
        ("DCGM_FI_DEV_FB_USED", Kind.MIB, "gauge"),
        ("DCGM_FI_DEV_FB_TOTAL", Kind.MIB, "gauge"),
        ("DCGM_FI_DEV_POWER_USAGE", Kind.FLOAT, "gauge"),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", Kind.INT, "counter"),
        ("DCGM_FI_DEV_GPU_TEMP", Kind.ROUND, "gauge"),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", Kind.FLOAT, "gauge"),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", Kind.ROUND, "gauge"),
        ("DCGM_FI_PROF_NVLINK_RX_BYTES", Kind.ROUND, "gauge"),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", Kind.INT, "counter"),
        ("DCGM_FI_DEV_RETIRED_PENDING", Kind.BOOL, "counter"),
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", Kind.BOOL, "gauge"),
        ("DCGM_FI_DEV_XID_ERRORS", Kind.XID_LAST, "gauge"),
        ("DCGM_EXP_XID_ERRORS_TOTAL", Kind.XID_TOTAL, "counter"),
        ("DCGM_FI_DRIVER_VERSION", Kind.LABEL, "label"),
    ],
)
def test_kind_and_type(name, kind, prom_type):
    spec = fields.lookup(name)
    assert spec is not None
    assert (spec.kind, spec.prom_type) == (kind, prom_type)


def test_lookup_unknown_is_none():
    assert fields.lookup("DCGM_FI_DEV_NVLINK_BANDWIDTH_L0") is None  # per-link bytes: not sampled
    assert fields.lookup("nope") is None


@pytest.mark.parametrize(
    ("kind", "value", "text"),
    [
        (Kind.PERCENT, 0.93, "93"),
        (Kind.PERCENT, 0.57, "57"),  # 0.57 * 100 = 56.99999...: rounded, not truncated
        (Kind.PERCENT, 1.0, "100"),
        (Kind.PERCENT, 0, "0"),
        (Kind.MIB, 81559 * MiB, "81559"),
        (Kind.MIB, 81559 * MiB + MiB - 1, "81559"),  # DCGM floors bytes to MiB
        (Kind.FLOAT, 612.5, "612.500000"),
        (Kind.FLOAT, 0.123456789, "0.123457"),
        (Kind.FLOAT, 3, "3.000000"),
        (Kind.ROUND, 61.6, "62"),
        (Kind.ROUND, 1.25e9, "1250000000"),
        (Kind.INT, 123456789012, "123456789012"),
        (Kind.INT, 7.6, "8"),
        (Kind.BOOL, True, "1"),
        (Kind.BOOL, False, "0"),
    ],
)
def test_format_value(kind, value, text):
    assert format_value(int(kind), value) == text


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "inf"),
        (-0.5, "negative"),
        (-1, "negative"),
        ("12", "invalid"),
        (None, "invalid"),
        ([1], "invalid"),
    ],
)
def test_format_value_rejects(value, reason):
    for kind in (Kind.INT, Kind.ROUND, Kind.PERCENT, Kind.MIB, Kind.FLOAT):
        with pytest.raises(InvalidValue) as exc:
            format_value(int(kind), value)
        assert exc.value.reason == reason


def test_signed_values_allowed_for_temperatures():
    spec = fields.lookup("DCGM_FI_DEV_GPU_TEMP")
    assert spec.signed
    assert format_value(int(spec.kind), -3.4, spec.signed) == "-3"
    assert not fields.lookup("DCGM_FI_DEV_POWER_USAGE").signed


def test_above_range_is_exposed_as_is():
    assert format_value(int(Kind.PERCENT), 1.37) == "137"
    assert format_value(int(Kind.FLOAT), 1.5) == "1.500000"
