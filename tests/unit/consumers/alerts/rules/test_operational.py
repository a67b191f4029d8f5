"""Operational events in the alerts: a known legacy Xid keeps its catalog row, else the category decides."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.rules.catalog import Action, CauseClass, Severity
from gpupipe_consumers.alerts.rules.classify import FaultEvent, classify
from gpupipe_consumers.alerts.rules.operational import refine
from gpupipe_producer.xid.events import XidContext
from gpupipe_producer.xid.operational_merge import Incident
from gpupipe_producer.xid.operational_record import operational_xid_event

T0 = 1_800_000_000_000


def _op(code: int, category: int, severity: int, module: str = "GPU-RAS", legacy: int | None = None) -> dict:
    return {
        "module_signature": module,
        "module_event_code": code,
        "category_id": category,
        "category": None,
        "severity": severity,
        "log_level": 50,
        "scope": 1,
        "originator": 1,
        "attributes": 0,
        "module_instance": 0,
        "chiplet_id": 0,
        "trace_id": 7,
        "instance_id": 7,
        "group_cursor": 7,
        "group_size": 1,
        "group_index": 0,
        "group_attributes": 0,
        "driver_timestamp_us": 1,
        "legacy_xid": legacy,
        "legacy_sources": [],
        "contexts": [],
    }


def _base(kind: str = "unknown", code: int | None = None) -> Any:
    return classify(FaultEvent(kind=kind, ts_ms=T0, code=code))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("category", "severity", "want"),
    [
        (2, 40, ("critical", Action.RESET_GPU, True, CauseClass.HARDWARE_MEMORY)),
        (2, 30, ("warning", Action.RESET_GPU, False, CauseClass.HARDWARE_MEMORY)),
        (2, 20, ("info", Action.IGNORE, False, CauseClass.HARDWARE_MEMORY)),
        (1, 40, ("critical", Action.RESTART_APP, False, CauseClass.DRIVER)),
        (3, 30, ("warning", Action.CHECK_MECHANICALS, False, CauseClass.BUS)),
        (4, 40, ("critical", Action.RESET_GPU, True, CauseClass.DRIVER)),
        (5, 30, ("warning", Action.CONTACT_SUPPORT, False, CauseClass.DRIVER)),
    ],
)
def test_an_unknown_code_is_classified_by_its_category_and_severity(
    category: int, severity: int, want: tuple[str, Action, bool, CauseClass]
) -> None:
    c = refine(_op(0x0FFF, category, severity), _base())
    assert c is not None
    assert (c.severity.value, c.action, c.drain_node, c.cause_class) == want
    assert c.rule.startswith("operational.category.") and not c.known and c.codes == ()


def test_an_unknown_category_gets_the_safe_default_and_never_pages() -> None:
    c = refine(_op(0x0001, 0x0042, 40), _base())
    assert c is not None
    assert (c.severity, c.action, c.drain_node, c.rule) == (
        Severity.WARNING,
        Action.CONTACT_SUPPORT,
        False,
        "operational.unknown_category",
    )


def test_an_nvlink_interconnect_error_is_the_fabric_s() -> None:
    c = refine(_op(0x0010, 3, 40, module="GPU-NVLINK"), _base())
    assert c is not None and c.cause_class is CauseClass.NVLINK_FABRIC


def test_a_known_legacy_xid_keeps_its_catalog_decision() -> None:
    base = _base("xid", 79)
    assert refine(_op(0x0003, 3, 40, module="GPU-BUS", legacy=79), base) is base
    assert refine(None, base) is base and refine(_op(1, 2, 40), None) is None
    # A legacy Xid newer than the catalog: the category decides, the Xid stays the alert's code.
    newer = refine(_op(0x0050, 2, 40, legacy=190), _base("xid", 190))
    assert (
        newer is not None
        and newer.codes == (190,)
        and newer.rule == "operational.category.MEMORY_INTEGRITY_ERROR"
    )


def _record(op: dict, *, xid_gpu: int = 3) -> dict:
    watcher_event = {
        "type": "operational",
        "uuid": f"GPU-{xid_gpu}",
        "pci_bus_id": f"00000000:{0x18 + 16 * xid_gpu:02X}:00.0",
        "gpu_index": xid_gpu,
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "legacy_xid": op["legacy_xid"],
        "timestamp_ms": T0,
        "nvml_seq": 1,
        "operational": op,
    }
    ev = operational_xid_event(Incident(operational=watcher_event), XidContext("node-a", {}, {}))
    ev["boot_id"] = "boot-A"
    return ev


def test_the_engine_alerts_on_the_producers_operational_record() -> None:
    e = EngineFacade(EngineConfig())
    e.on_xid(_record(_op(0x0FFF, 2, 40)), T0)
    (alert,) = [to_record(a, T0) for a in e.take(T0)]
    assert (alert["severity"], alert["action"], alert["drain_node"], alert["rule"]) == (
        "critical",
        "RESET_GPU",
        True,
        "operational.category.MEMORY_INTEGRITY_ERROR",
    )
    assert alert["gpu_uuid"] == "GPU-3"


def test_the_engine_classifies_xid_185_from_the_catalog() -> None:
    e = EngineFacade(EngineConfig())
    rec = _record(_op(0x003D, 2, 30, legacy=185))
    assert (rec["kind"], rec["xid"]) == ("xid", 185)
    e.on_xid(rec, T0)
    (alert,) = [to_record(a, T0) for a in e.take(T0)]
    assert alert["xid_codes"] == [185] and alert["known"] and alert["name"] == "SPARING_EVENT"
