"""Report building: range filter, grouping, team mapping, partial and correction merging."""

from __future__ import annotations

import pytest

from gpupipe.domain.teams import TeamMap, TeamMapError, load_team_map, parse_team_map
from gpupipe_consumers.report.chargeback_report import (
    build_report,
    parse_time_ms,
    read_records_jsonl,
)
from gpupipe_consumers.report.errors import ReportOptionError
from tests.paths import REPO, TESTS

FIXTURES = TESTS / "fixtures" / "chargeback"
REPO = REPO
T0 = 1_767_225_600_000
H = 3_600_000


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return read_records_jsonl((FIXTURES / "windows.jsonl").read_text().splitlines())


@pytest.fixture(scope="module")
def teams() -> TeamMap:
    return load_team_map(FIXTURES / "teams.yaml")


# -- time parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("2026-01-01", T0),
        ("2026-01-01T00:00:00Z", T0),
        ("2026-01-01T01:00", T0 + H),
        ("2026-01-01T02:00:00+01:00", T0 + H),
        (" 2026-01-01T00:30:00.5Z ", T0 + 1_800_500),
    ],
)
def test_parse_time(text, ms):
    assert parse_time_ms(text) == ms


@pytest.mark.parametrize("text", ["yesterday", "2026-13-01", ""])
def test_parse_time_rejects(text):
    with pytest.raises(ReportOptionError):
        parse_time_ms(text)


# -- team mapping ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("namespace", "team"),
    [
        ("ml-train", "ml-platform"),  # exact rule before the glob
        ("ml-infer", "ml-serving"),
        ("research-a", "research"),
        ("research", "research"),  # unmapped: its own team (by coincidence the same name)
        ("kube-system", "kube-system"),
        ("__unallocated__", "__unallocated__"),
        ("__mig_shared__", "__mig_shared__"),
    ],
)
def test_team_of(teams, namespace, team):
    assert teams.team_of(namespace) == team


def test_catch_all_rule_never_hides_pseudo_namespaces():
    tm = parse_team_map({"teams": [{"namespace": "*", "team": "everyone"}]})
    assert tm.team_of("anything") == "everyone"
    assert tm.team_of("__unallocated__") == "__unallocated__"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([], "one key"),
        ({"team": []}, "one key"),
        ({"teams": {"a": "b"}}, "list"),
        ({"teams": [{"namespace": "a"}]}, "teams[0]"),
        ({"teams": [{"namespace": "", "team": "x"}]}, "non-empty"),
    ],
)
def test_invalid_team_maps(data, fragment):
    with pytest.raises(TeamMapError) as exc:
        parse_team_map(data, "teams.yaml")
    assert fragment in str(exc.value) and "teams.yaml" in str(exc.value)


def test_example_team_file_and_empty_file(tmp_path):
    tm = load_team_map(REPO / "deploy" / "teams.example.yaml")
    assert tm.team_of("ml-train") == "ml-platform" and tm.team_of("kube-system") == "platform"
    empty = tmp_path / "t.yaml"
    empty.write_text("")
    assert load_team_map(empty).rules == ()
    with pytest.raises(TeamMapError, match="cannot read"):
        load_team_map(tmp_path / "missing.yaml")


# -- building -------------------------------------------------------------------------------------
def _index(rows, *fields):
    return {tuple(getattr(r, f) for f in fields): r for r in rows}


def test_partials_and_corrections_are_summed(records, teams):
    rows = build_report(records, by=("namespace",), teams=teams, start_ms=T0, end_ms=T0 + 2 * H)
    idx = _index(rows, "window_start_ms", "namespace", "gpu_model")
    ml = idx[(T0, "ml-train", "NVIDIA H200")]
    assert ml.gpu_hours_allocated == pytest.approx(4.0 + 2.0 + 0.5)  # two partitions + a correction
    assert ml.gpu_hours_used == pytest.approx(3.2 + 1.5 + 0.4)
    assert ml.gpu_hours_idle == pytest.approx(0.5)
    assert ml.energy_kwh == pytest.approx(2.4 + 1.1 + 0.3)
    assert ml.cost == pytest.approx(6.5 * 4.10 + 3.8 * 0.14)
    assert (ml.team, ml.kind, ml.records) == ("ml-platform", "total", 3)
    assert idx[(T0, "kube-system", "NVIDIA H100 80GB HBM3")].team == "ops"  # the record's own team
    assert idx[(T0, "research-a", "Acme X1")].default_price


def test_range_filter_keeps_windows_starting_inside(records):
    assert {r.window_start_ms for r in build_report(records)} == {T0, T0 + H, T0 + 2 * H}
    assert {r.window_start_ms for r in build_report(records, start_ms=T0 + H)} == {T0 + H, T0 + 2 * H}
    assert {r.window_start_ms for r in build_report(records, end_ms=T0 + H)} == {T0}
    assert build_report(records, start_ms=T0 + 1, end_ms=T0 + H) == []


def test_group_by_team(records, teams):
    rows = build_report(records, by=("team",), teams=teams, start_ms=T0, end_ms=T0 + H)
    idx = _index(rows, "team", "gpu_model")
    assert all(r.namespace is None for r in rows)
    assert idx[("ml-serving", "NVIDIA H100 80GB HBM3")].gpu_hours_allocated == pytest.approx(1.5)
    assert idx[("__unallocated__", "NVIDIA H100 80GB HBM3")].gpu_hours_allocated == pytest.approx(0.75)
    assert rows[-1].team in ("__unallocated__", "__mig_shared__")  # pseudo rows come last


def test_group_by_node_traces_unallocated_capacity(records):
    rows = build_report(records, by=("node", "namespace"), period="all", start_ms=T0, end_ms=T0 + 2 * H)
    un = {r.node: r.gpu_hours_allocated for r in rows if r.namespace == "__unallocated__"}
    assert un == pytest.approx({"gpu-node-00": 0.5, "gpu-node-01": 1.75})


@pytest.mark.parametrize(
    ("period", "bounds"),
    [
        ("window", {(T0, T0 + H), (T0 + H, T0 + 2 * H)}),
        ("hour", {(T0, T0 + H), (T0 + H, T0 + 2 * H)}),
        ("day", {(T0, T0 + 24 * H)}),
        ("month", {(T0, T0 + 31 * 24 * H)}),
        ("all", {(T0, T0 + 2 * H)}),
    ],
)
def test_periods(records, period, bounds):
    rows = build_report(records, period=period, start_ms=T0, end_ms=T0 + 2 * H)
    assert {(r.window_start_ms, r.window_end_ms) for r in rows} == bounds


def test_period_all_without_range_spans_the_records(records):
    rows = build_report(records, period="all")
    assert {(r.window_start_ms, r.window_end_ms) for r in rows} == {(T0, T0 + 3 * H)}


def test_split_corrections_keeps_them_apart(records):
    rows = build_report(records, split_corrections=True, start_ms=T0, end_ms=T0 + H)
    kinds = {(r.namespace, r.node if r.node else "", r.kind) for r in rows if r.namespace == "ml-train"}
    assert kinds == {("ml-train", "", "window"), ("ml-train", "", "correction")}


def test_totals_are_preserved_by_any_grouping(records, teams):
    def total(rows):
        return sum(r.gpu_hours_allocated for r in rows), sum(r.cost for r in rows)

    ref = total(build_report(records, teams=teams))
    for by in (("team",), ("node",), ("namespace", "node"), ("team", "node")):
        for period in ("window", "day", "all"):
            assert total(build_report(records, by=by, teams=teams, period=period)) == pytest.approx(ref)


def test_currencies_are_never_mixed(records):
    eur = [dict(records[0], currency="EUR")]
    rows = build_report(records[:1] + eur)
    assert sorted(r.currency for r in rows) == ["EUR", "USD"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"by": ()},
        {"by": ("pod",)},
        {"by": ("team", "team")},
        {"period": "week"},
        {"start_ms": T0 + H, "end_ms": T0},
    ],
)
def test_invalid_options(records, kwargs):
    with pytest.raises(ReportOptionError):
        build_report(records, **kwargs)


def test_read_records_jsonl_errors():
    assert read_records_jsonl(["", "  "]) == []
    with pytest.raises(ReportOptionError, match="line 2"):
        read_records_jsonl(["{}", "nope"])
    with pytest.raises(ReportOptionError, match="object"):
        read_records_jsonl(["[1]"])
