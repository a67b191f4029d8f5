"""Pure parts of the NVML source: unit conversions and the garbage policy, MIG profile names,
field-value unions. No NVML, no fake."""

from __future__ import annotations

import pynvml
import pytest

from gpupipe_producer.nvml import convert
from gpupipe_producer.nvml.mig import MigProfile, parse_mig_profile, slice_fraction

NAN = float("nan")
INF = float("inf")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (0, 0.0),
        (87, 0.87),
        (100, 1.0),
        (101, None),
        (255, None),  # NVML garbage seen in the wild
        (-1, None),
        (0xFFFFFFFF, None),  # NVML_VALUE_NOT_AVAILABLE / -1 through a c_uint
        (NAN, None),
        (INF, None),
        ("87", None),
        (None, None),
    ],
)
def test_pct_to_ratio(raw, expected):
    assert convert.pct_to_ratio(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (92.5, 0.925),
        (100.4, 1.0),  # rounding overshoot of two counters: clamped
        (-0.3, 0.0),
        (101.5, None),  # beyond the slack: garbage
        (250.0, None),
        (NAN, None),
    ],
)
def test_gpm_pct_to_ratio(raw, expected):
    assert convert.gpm_pct_to_ratio(raw) == expected


@pytest.mark.parametrize(
    ("fn", "raw", "expected"),
    [
        (convert.mw_to_w, 512_345, 512.345),
        (convert.mw_to_w, 0, 0.0),
        (convert.mw_to_w, NAN, None),
        (convert.mw_to_w, -5, None),
        (convert.mw_to_w, 0xFFFFFFFF, None),
        (convert.mw_to_w, 20_000_000, None),  # 20 kW on one board
        (convert.kib_per_s_to_bytes_per_s, 123_456, 123_456 * 1024.0),
        (convert.kib_per_s_to_bytes_per_s, -1, None),
        (convert.mib_per_s_to_bytes_per_s, 100.0, 100.0 * 1024 * 1024),
        (convert.mib_per_s_to_bytes_per_s, NAN, None),
        (convert.count, 123_456_789_012, 123_456_789_012),
        (convert.count, 5.0, 5),
        (convert.count, 5.5, None),
        (convert.count, -1, None),
        (convert.count, 0xFFFFFFFFFFFFFFFF, None),
        (convert.count, 2**63, None),  # does not fit Avro long
        (convert.small_int, 2**31, None),  # does not fit Avro int
        (convert.small_int, 4, 4),
        (convert.celsius, 61, 61.0),
        (convert.celsius, -300, None),
        (convert.celsius, 4294967295, None),
        (convert.mhz, 1980, 1980),
        (convert.mhz, 0xFFFFFFFF, None),
        (convert.flag, 0, False),
        (convert.flag, 1, True),
        (convert.flag, 2, None),
    ],
)
def test_converters(fn, raw, expected):
    got = fn(raw)
    assert got == expected
    if expected is not None:
        assert type(got) is type(expected)


def test_converted_values_are_the_avro_types():
    assert isinstance(convert.count(5), int)
    assert isinstance(convert.mw_to_w(5), float)
    assert isinstance(convert.kib_per_s_to_bytes_per_s(5), float)
    assert isinstance(convert.flag(1), bool)
    assert isinstance(convert.mhz(True), int)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", MigProfile("3g.40gb", 3)),
        ("NVIDIA H200 MIG 1g.18gb", MigProfile("1g.18gb", 1)),
        ("NVIDIA A100-SXM4-80GB MIG 7g.80gb", MigProfile("7g.80gb", 7)),
        ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", MigProfile("3g.20gb", 1)),  # CI smaller than its GI
        ("NVIDIA A100-SXM4-80GB MIG 1g.10gb+me", MigProfile("1g.10gb+me", 1)),
        ("NVIDIA H100 80GB HBM3", None),
        ("", None),
    ],
)
def test_parse_mig_profile(name, expected):
    assert parse_mig_profile(name) == expected


def test_slice_fraction():
    assert slice_fraction(3, 7) == pytest.approx(3 / 7)
    assert slice_fraction(4, 4) == 1.0  # A30
    assert slice_fraction(3, 0) == pytest.approx(3 / 7)  # unknown maximum: 7 slices
    assert slice_fraction(9, 7) == 1.0


@pytest.mark.parametrize(
    ("vtype", "member", "value"),
    [
        (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 1.5),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 70),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2**40),
        (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -3),
        (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "siVal", -7),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "usVal", 9),
    ],
)
def test_field_value_reads_the_union_member_of_its_type(vtype, member, value):
    fv = pynvml.c_nvmlFieldValue_t()
    fv.valueType = vtype
    setattr(fv.value, member, value)
    assert convert.field_value(fv) == value


def test_field_value_unknown_type_is_none():
    fv = pynvml.c_nvmlFieldValue_t()
    fv.valueType = 42
    assert convert.field_value(fv) is None
