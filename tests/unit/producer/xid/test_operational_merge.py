"""One record per incident: a legacy Xid and its operational event pair on the node (pure logic)."""

from __future__ import annotations

from typing import Any

from gpupipe_producer.xid.operational_merge import Incident, OperationalMerger, legacy_sources, window_for

BUS = "00000000:3B:00.0"
KEY = "0000:3b:00.0"  # what the Xid merger emits (canonical)


def _op(xid: int | None, bus: str = BUS) -> dict[str, Any]:
    return {"type": "operational", "pci_bus_id": bus, "legacy_xid": xid, "operational": {"legacy_xid": xid}}


def _legacy(xid: int, source: str = "nvml+kmsg", bus: str = KEY, **kw: Any) -> dict[str, Any]:
    return {"kind": "xid", "xid": xid, "pci_bus_id": bus, "source": source, **kw}


def _merger(window: float = 1.0) -> OperationalMerger:
    return OperationalMerger(window, capable=lambda pci: pci == KEY)


def test_legacy_then_structured_is_one_incident_released_with_the_second() -> None:
    m = _merger()
    assert m.legacy(_legacy(185), 10.0) == [] and len(m) == 1
    out = m.operational(_op(185), 10.3)
    assert len(out) == 1 and out[0].operational is not None and out[0].legacy is not None
    assert len(m) == 0 and m.paired == 1
    assert legacy_sources(out[0].legacy) == ["nvml", "kmsg"]


def test_structured_then_legacy_pairs_too() -> None:
    m = _merger()
    assert m.operational(_op(79), 5.0) == []
    [inc] = m.legacy(_legacy(79, "kmsg"), 5.9)
    assert inc.operational is not None and legacy_sources(inc.legacy) == ["kmsg"]


def test_a_late_second_legacy_half_is_absorbed_not_published() -> None:
    m = _merger()
    m.legacy(_legacy(185, "nvml"), 1.0)
    [inc] = m.operational(_op(185), 1.1)
    assert inc.legacy is not None
    assert m.legacy(_legacy(185, "kmsg"), 1.8) == []  # the Xid merger released the kernel half late
    assert m.absorbed == 1
    # Past the window the same code is a new incident again.
    assert m.legacy(_legacy(185, "kmsg"), 2.2) == [] and len(m) == 1


def test_what_finds_no_partner_within_the_window_is_released_alone() -> None:
    m = _merger()
    m.operational(_op(185), 0.0)
    m.legacy(_legacy(48), 0.2)  # another code: no pair
    assert m.expire(0.9) == []
    out = m.expire(1.0)
    assert [(i.operational is not None, i.legacy is not None) for i in out] == [(True, False)]
    assert [(i.operational is not None, i.legacy is not None) for i in m.expire(1.2)] == [(False, True)]


def test_other_gpu_or_other_code_never_pair() -> None:
    m = _merger()
    m.operational(_op(185, bus="00000000:9B:00.0"), 0.0)
    assert m.legacy(_legacy(185), 0.1) == [] and len(m) == 2
    assert m.legacy(_legacy(79), 0.2) == [] and len(m) == 3


def test_pass_through_where_nothing_can_pair() -> None:
    m = _merger()
    [a] = m.operational(_op(None), 0.0)  # no legacy Xid: nothing to wait for
    assert a.operational is not None and a.legacy is None
    [b] = m.legacy(_legacy(13, bus="0000:9b:00.0"), 0.0)  # a GPU not registered for operational events
    [c] = m.legacy({"kind": "sxid", "xid": 12028, "pci_bus_id": "0000:05:00", "source": "kmsg"}, 0.0)
    assert b.legacy is not None and c.legacy is not None and len(m) == 0


def test_held_kernel_sightings_hold_the_cursor_and_flush_releases_everything() -> None:
    m = _merger()
    m.legacy(_legacy(185, "kmsg", kmsg_seq=42), 0.0)
    m.legacy(_legacy(48, "kmsg", kmsg_seq=40), 0.1)
    m.operational(_op(79), 0.2)
    assert m.held_field_min("kmsg_seq") == 40
    out = m.flush()
    assert len(out) == 3 and all(isinstance(i, Incident) for i in out) and len(m) == 0


def test_the_window_outlasts_the_xid_mergers() -> None:
    assert window_for(0.5) > 0.5 and window_for(0.0) > 0.0
