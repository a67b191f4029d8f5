"""The pinned XID / SXid catalog: data integrity, lookups, the unknown-code default."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
from importlib import resources

import pytest

from gpupipe_consumers.alerts.rules import catalog
from gpupipe_consumers.alerts.rules.catalog import (
    CATALOG_DATE,
    CATALOG_VERSION,
    Action,
    CatalogError,
    CauseClass,
    Severity,
    entries,
    lookup,
    parse_catalog,
)

RAW_TEXT = resources.files("gpupipe_schemas").joinpath("xid_catalog.json").read_text(encoding="utf-8")
RAW = json.loads(RAW_TEXT)
GPUS = {"A100", "H100", "B100", "GB200"}

# Codes the reference (shared/reference/xid-catalog.md §2) lists explicitly; all must be known.
REFERENCE_XIDS = [
    8, 13, 31, 32, 38, 43, 44, 45, 46, 48, 54, 56, 57, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 110,
    119, 120, 121, 122, 123, 124, 136, 137, 140, 143, *range(144, 151), 154, 155, 158, 160,
]  # fmt: skip


# ------------------------------------------------------------------------------------ data integrity


def test_top_level_shape():
    assert set(RAW) >= {"catalog_version", "catalog_date", "source", "xids", "sxids"}
    assert RAW["catalog_version"] == CATALOG_VERSION
    assert RAW["catalog_date"] == CATALOG_DATE
    datetime.date.fromisoformat(CATALOG_DATE)
    assert isinstance(RAW["source"], dict) and {"xid", "sxid"} <= set(RAW["source"])


@pytest.mark.parametrize("table", ["xids", "sxids"])
def test_every_entry_uses_valid_enum_members(table):
    for row in RAW[table]:
        # nvidia_action holds only NVIDIA's buckets: null where NVIDIA gives none, ours apart
        assert (row["nvidia_action"] is None) != (row.get("action") is None), row["code"]
        assert (row["nvidia_action"] or row["action"]) in {a.value for a in Action}, row["code"]
        assert row["severity"] in {s.value for s in Severity}, row["code"]
        assert row["cause_class"] in {c.value for c in CauseClass} - {"unknown"}, row["code"]
        assert isinstance(row["drain_node"], bool), row["code"]
        assert isinstance(row["code"], int) and row["code"] > 0
        for text in ("name", "description", "runbook"):
            assert isinstance(row[text], str) and row[text].strip(), (row["code"], text)


@pytest.mark.parametrize("table", ["xids", "sxids"])
def test_no_duplicate_codes_and_sorted(table):
    codes = [row["code"] for row in RAW[table]]
    assert len(codes) == len(set(codes))
    assert codes == sorted(codes)


def test_xid_table_is_the_whole_catalog_up_to_the_newest_documented_code():
    # 1-172 from NVIDIA's catalog page, 173-176 from the driver's nverror.h up to 595.45.04, 185 from the
    # R620 GPU Operational Events release notes; 177-184 are documented nowhere we read: absent.
    assert [row["code"] for row in RAW["xids"]] == [*range(1, 177), 185]
    assert not any(lookup(code).known for code in range(177, 185))
    assert all(set(row["applies_to"]) <= GPUS for row in RAW["xids"])


@pytest.mark.parametrize("code", REFERENCE_XIDS)
def test_reference_codes_are_known(code):
    info = lookup(code)
    assert info.known and info.code == code and info.kind == "xid"


@pytest.mark.parametrize("kind", ["xid", "sxid"])
def test_policy_invariants(kind):
    for info in entries(kind):
        if info.drain_node:  # draining is never a quiet event
            assert info.severity is Severity.CRITICAL, info.code
        if info.bucket is Action.IGNORE:
            assert info.severity is not Severity.CRITICAL, info.code
            assert not info.drain_node, info.code


def test_sxids_carry_their_fabric_manager_class():
    assert {info.fatality for info in entries("sxid")} == {"non_fatal", "fatal", "always_fatal", "notable"}
    assert all(row["fm_guide_section"].startswith("D.") for row in RAW["sxids"])


def test_catalog_ships_as_package_data():
    assert resources.files("gpupipe_schemas").joinpath("xid_catalog.json").is_file()


def test_entries_match_table_sizes():
    assert len(entries("xid")) == len(RAW["xids"]) == 177  # 1-176 and 185
    assert len(entries("sxid")) == len(RAW["sxids"])
    assert len(entries("sxid")) >= 60


# ----------------------------------------------------------------------------------------- lookups


@pytest.mark.parametrize(
    ("code", "action", "severity", "cause", "drain"),
    [
        (13, Action.RESTART_APP, Severity.WARNING, CauseClass.APPLICATION, False),
        (31, Action.RESTART_APP, Severity.WARNING, CauseClass.APPLICATION, False),
        (32, Action.RESTART_APP, Severity.WARNING, CauseClass.BUS, False),
        (38, Action.IGNORE, Severity.INFO, CauseClass.DRIVER, False),
        (43, Action.IGNORE, Severity.INFO, CauseClass.APPLICATION, False),
        (45, Action.WORKFLOW_XID_45, Severity.INFO, CauseClass.APPLICATION, False),
        (48, Action.WORKFLOW_XID_48, Severity.CRITICAL, CauseClass.HARDWARE_MEMORY, True),
        (54, Action.CHECK_MECHANICALS, Severity.WARNING, CauseClass.THERMAL_POWER, False),
        (56, Action.CONTACT_SUPPORT, Severity.WARNING, CauseClass.DRIVER, False),
        (62, Action.RESET_GPU, Severity.CRITICAL, CauseClass.DRIVER, True),
        (63, Action.IGNORE, Severity.INFO, CauseClass.HARDWARE_MEMORY, False),
        (64, Action.RESET_GPU, Severity.CRITICAL, CauseClass.HARDWARE_MEMORY, True),
        (74, Action.WORKFLOW_NVLINK_ERR, Severity.CRITICAL, CauseClass.NVLINK_FABRIC, True),
        (78, Action.UPDATE_SWFW, Severity.WARNING, CauseClass.DRIVER, False),
        (79, Action.RESTART_BM, Severity.CRITICAL, CauseClass.BUS, True),
        (92, Action.IGNORE, Severity.WARNING, CauseClass.HARDWARE_MEMORY, False),
        (94, Action.RESTART_APP, Severity.WARNING, CauseClass.HARDWARE_MEMORY, False),
        (95, Action.RESET_GPU, Severity.CRITICAL, CauseClass.HARDWARE_MEMORY, True),
        (119, Action.RESET_GPU, Severity.CRITICAL, CauseClass.DRIVER, True),
        (120, Action.RESET_GPU, Severity.CRITICAL, CauseClass.DRIVER, True),
        (121, Action.IGNORE, Severity.INFO, CauseClass.NVLINK_FABRIC, False),
        (149, Action.WORKFLOW_NVLINK5_ERR, Severity.WARNING, CauseClass.NVLINK_FABRIC, False),
        (151, Action.RESTART_VM, Severity.CRITICAL, CauseClass.DRIVER, True),  # bare metal: a reboot
        (154, Action.XID_154, Severity.WARNING, CauseClass.DRIVER, False),
        (159, Action.CHECK_UVM, Severity.WARNING, CauseClass.NVLINK_FABRIC, False),
    ],
)
def test_xid_lookup(code, action, severity, cause, drain):
    info = lookup(code)
    assert (info.nvidia_action, info.severity, info.cause_class, info.drain_node) == (
        action,
        severity,
        cause,
        drain,
    )
    assert info.known and info.runbook


@pytest.mark.parametrize(
    ("code", "name", "fatality", "action", "severity", "drain"),
    [
        (11012, "Single bit ECC errors", "non_fatal", Action.IGNORE, Severity.INFO, False),
        (22013, "Minion Link DLREQ interrupt", "non_fatal", Action.IGNORE, Severity.INFO, False),
        (20034, "LTSSM Fault Up", "fatal", Action.RESET_GPU, Severity.CRITICAL, True),
        (12022, "egress input ECC DBE error", "fatal", Action.RESTART_BM, Severity.CRITICAL, True),
        (12020, "egress sequence ID error", "always_fatal", Action.RESTART_BM, Severity.CRITICAL, True),
        (22003, "Minion Halt", "always_fatal", Action.RESTART_BM, Severity.CRITICAL, True),
        (10004, "Host_thermal_event_start", "notable", Action.IGNORE, Severity.WARNING, False),
    ],
)
def test_sxid_lookup(code, name, fatality, action, severity, drain):
    info = lookup(code, "sxid")
    assert info.known and info.kind == "sxid"
    assert info.nvidia_action is None  # the Fabric Manager guide gives no buckets: ours is info.action
    assert (info.name, info.fatality, info.bucket, info.severity, info.drain_node) == (
        name,
        fatality,
        action,
        severity,
        drain,
    )


def test_10004_is_thermal():
    assert lookup(10004, "sxid").cause_class is CauseClass.THERMAL_POWER


@pytest.mark.parametrize(
    ("code", "kind"), [(999, "xid"), (177, "xid"), (0, "xid"), (-1, "xid"), (13, "sxid")]
)
def test_unknown_code_gets_safe_default(code, kind):
    info = lookup(code, kind)
    assert info.known is False
    assert info.code == code and info.kind == kind
    assert info.nvidia_action is None and info.bucket is Action.CONTACT_SUPPORT
    assert info.severity is Severity.WARNING
    assert info.cause_class is CauseClass.UNKNOWN
    assert info.drain_node is False
    assert CATALOG_VERSION in info.description
    assert info.runbook


def test_xid_and_sxid_tables_are_separate():
    assert lookup(20034).known is False
    assert lookup(79, "sxid").known is False


def test_bad_kind_raises():
    with pytest.raises(ValueError, match="kind"):
        lookup(13, "nvswitch")  # type: ignore[arg-type]


def test_xidinfo_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        lookup(13).severity = Severity.INFO  # type: ignore[misc]


def test_enums_are_strings_for_the_schema():
    assert Severity.CRITICAL == "critical"
    assert Action.RESET_GPU == "RESET_GPU"
    assert CauseClass("hardware_memory") is CauseClass.HARDWARE_MEMORY
    assert json.dumps({"a": Action.RESTART_BM}) == '{"a": "RESTART_BM"}'


def test_module_constants():
    assert catalog.CATALOG_VERSION and catalog.CATALOG_DATE


# ------------------------------------------------------------------------------------ the validator


def _mutated(mutate):
    doc = copy.deepcopy(RAW)
    mutate(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["xids"].append(copy.deepcopy(d["xids"][12])), "duplicate xid code 13"),
        (lambda d: d["sxids"].append(copy.deepcopy(d["sxids"][0])), "duplicate sxid code"),
        (lambda d: d["xids"][0].update(nvidia_action="REBOOT_PLEASE"), "REBOOT_PLEASE"),
        (lambda d: d["xids"][0].update(severity="page"), "page"),
        (lambda d: d["xids"][0].update(cause_class="cosmic_rays"), "cosmic_rays"),
        (lambda d: d["xids"][0].update(cause_class="unknown"), "reserved"),
        (lambda d: d["xids"][0].update(drain_node="yes"), "drain_node"),
        (lambda d: d["xids"][0].update(code="13"), "positive integer"),
        (lambda d: d["xids"][0].pop("runbook"), "missing runbook"),
        (lambda d: d["xids"][0].update(runbook="  "), "runbook"),
        (lambda d: d.pop("catalog_date"), "catalog_date"),
        (lambda d: d.update(sxids={}), "must be a list"),
    ],
)
def test_parse_catalog_rejects_defects(mutate, message):
    with pytest.raises(CatalogError, match=message):
        parse_catalog(_mutated(mutate))


def test_parse_catalog_rejects_bad_json():
    with pytest.raises(CatalogError, match="JSON"):
        parse_catalog(RAW_TEXT[:-10])


def test_parse_catalog_roundtrip():
    parsed = parse_catalog(RAW_TEXT)
    assert parsed.version == CATALOG_VERSION
    assert parsed.xids[48] == lookup(48)


def test_xid_185_is_the_memory_sparing_event_of_operational_events():
    info = lookup(185)
    assert info.known and info.name == "SPARING_EVENT" and info.nvidia_action is None
    assert info.cause_class is CauseClass.HARDWARE_MEMORY and not info.drain_node
    assert "release notes" in info.notes
