"""PromQL reading every naming generation (pure): the rewrite of our rules' and dashboards' queries.

The expected rewrites are written out here; the unit factors are checked against what the metrics
service serves under both names for one known sample (``test_dialect.EXPECTED``).
"""

from __future__ import annotations

import operator

import pytest

from gpupipe_consumers.metrics import dialect, fields
from gpupipe_consumers.metrics.dialect_promql import (
    every_generation,
    every_generation_match,
    renamed_reads,
    to_48_unit,
)
from gpupipe_consumers.metrics.fields import Kind
from tests.unit.consumers.metrics.test_dialect import EXPECTED

CASES = [
    # an instant read: either name; the newer in the 4.8 unit
    ("DCGM_FI_DEV_GPU_TEMP > 85", "(DCGM_FI_DEV_GPU_TEMP or DCGM_FI_DEV_GPU_TEMP_CELSIUS) > 85"),
    (
        'avg(DCGM_FI_DEV_GPU_UTIL{pod!=""})',
        'avg(DCGM_FI_DEV_GPU_UTIL{pod!=""} or DCGM_FI_DEV_GPU_UTIL_RATIO{pod!=""} * 100)',
    ),
    (
        'sum by (h) (DCGM_FI_DEV_FB_USED{a="}x"})',
        'sum by (h) (DCGM_FI_DEV_FB_USED{a="}x"} or DCGM_FI_DEV_FB_USED_BYTES{a="}x"} / 1048576)',
    ),
    # a range read: the function applied to each name, the factor after it where it scales
    (
        "max_over_time(DCGM_FI_DEV_SM_CLOCK[5m]) > 1000",
        "(max_over_time(DCGM_FI_DEV_SM_CLOCK[5m])"
        " or max_over_time(DCGM_FI_DEV_SM_CLOCK_HERTZ[5m]) / 1e6) > 1000",
    ),
    (
        "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[$__rate_interval])",
        "(rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[$__rate_interval])"
        " or rate(DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL[$__rate_interval]) * 1000)",
    ),
    (
        "changes(DCGM_FI_DEV_GPU_UTIL[1h])",
        "(changes(DCGM_FI_DEV_GPU_UTIL[1h]) or changes(DCGM_FI_DEV_GPU_UTIL_RATIO[1h]))",
    ),
    # nothing there means nothing under either name
    (
        "absent(DCGM_FI_DEV_GPU_TEMP)",
        "(absent(DCGM_FI_DEV_GPU_TEMP) and absent(DCGM_FI_DEV_GPU_TEMP_CELSIUS))",
    ),
    # a sample's time is its own, not the evaluation's
    (
        "time() - timestamp(DCGM_FI_DEV_POWER_USAGE)",
        "time() - (timestamp(DCGM_FI_DEV_POWER_USAGE) or timestamp(DCGM_FI_DEV_BOARD_POWER_WATTS))",
    ),
    (
        "x unless DCGM_FI_DEV_ROW_REMAP_FAILURE offset 5m",
        "x unless (DCGM_FI_DEV_ROW_REMAP_FAILURE offset 5m or DCGM_FI_DEV_ROW_REMAP_FAILED offset 5m)",
    ),
    # 4.10's renames
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "(DCGM_FI_PROF_PCIE_TX_BYTES or DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND)",
    ),
    # untouched: names nobody renamed, names in strings, newer names written by hand
    ('DCGM_EXP_XID_ERRORS_TOTAL{xid="79"} and DCGM_FI_DEV_ECC_DBE_VOL_TOTAL', None),
    ('label_replace(up, "m", "DCGM_FI_DEV_GPU_TEMP", "", "")', None),
    ("DCGM_FI_DEV_GPU_TEMP_CELSIUS > 85", None),
]


@pytest.mark.parametrize(("expr", "want"), CASES)
def test_each_read_of_a_renamed_field_reads_every_name(expr: str, want: str | None) -> None:
    got = every_generation(expr)
    assert got == (want or expr)
    assert every_generation(got) == got  # idempotent: the shipped rules are their own source


def test_renamed_reads_are_the_either_name_parts() -> None:
    expr = every_generation(
        "max by (u) (max_over_time(DCGM_FI_DEV_GPU_TEMP[1h])) unless absent(DCGM_FI_DEV_GPU_UTIL)"
    )
    assert renamed_reads(expr) == [
        "(max_over_time(DCGM_FI_DEV_GPU_TEMP[1h]) or max_over_time(DCGM_FI_DEV_GPU_TEMP_CELSIUS[1h]))",
        "(absent(DCGM_FI_DEV_GPU_UTIL) and absent(DCGM_FI_DEV_GPU_UTIL_RATIO))",
    ]
    assert renamed_reads("DCGM_EXP_XID_ERRORS_TOTAL") == []


def test_every_renamed_metric_is_rewritten_once() -> None:
    for r in dialect.RENAMES:
        if fields.BY_NAME[r.old].kind is Kind.LABEL:
            continue
        once = every_generation(f"sum({r.old})")
        assert once == f"sum({r.old} or {r.new}{to_48_unit(r)})"
        assert every_generation(once) == once


def test_factors_give_the_48_value_of_what_the_service_serves() -> None:
    """Each factor turns the newer value the service renders into the 4.8 value it renders for the
    same sample, to the coarser rounding (whole %, whole MiB; whole J for energy)."""
    ops = {"*": operator.mul, "/": operator.truediv}
    changed = [r for r in dialect.RENAMES if r.unit_change]
    assert len(changed) == 11
    for r in changed:
        v48, new, v49 = EXPECTED[r.old]
        assert new == r.new
        op, num = to_48_unit(r).split()
        tol = 1000.0 if r.kind is Kind.JOULES else 1.0
        assert ops[op](float(v49), float(num)) == pytest.approx(float(v48), abs=tol), r.old


@pytest.mark.parametrize(
    "expr",
    [
        "quantile_over_time(0.9, DCGM_FI_DEV_GPU_TEMP[5m])",  # not a one-argument function
        "DCGM_FI_DEV_GPU_TEMP[5m]",  # a bare range
        "sum by (DCGM_FI_DRIVER_VERSION) (up)",  # the renamed label
        "DCGM_FI_DEV_GPU_TEMP @ 1700000000",
    ],
)
def test_what_cannot_be_rewritten_faithfully_is_refused(expr: str) -> None:
    with pytest.raises(ValueError):
        every_generation(expr)


def test_a_series_selector_matches_every_name() -> None:
    assert every_generation_match('DCGM_FI_DEV_GPU_UTIL{Hostname=~"$node"}') == (
        '{__name__=~"DCGM_FI_DEV_GPU_UTIL|DCGM_FI_DEV_GPU_UTIL_RATIO", Hostname=~"$node"}'
    )
    assert every_generation_match("DCGM_FI_DEV_GPU_TEMP") == (
        '{__name__=~"DCGM_FI_DEV_GPU_TEMP|DCGM_FI_DEV_GPU_TEMP_CELSIUS"}'
    )
    assert every_generation_match("DCGM_EXP_XID_ERRORS_TOTAL") == "DCGM_EXP_XID_ERRORS_TOTAL"
    done = every_generation_match("DCGM_FI_DEV_GPU_TEMP")
    assert every_generation_match(done) == done
