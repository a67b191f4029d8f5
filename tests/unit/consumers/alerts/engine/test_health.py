"""Health signals from GpuSample fields (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe_consumers.alerts.engine.alert_record import alert_device_key
from gpupipe_consumers.alerts.engine.health_signals import (
    HealthConfig,
    HealthTracker,
    InvalidRecord,
)

T0 = 1_800_000_000_000
S = 1000


def sample(ts: int = T0, **kw: Any) -> dict[str, Any]:
    base = {
        "timestamp_ms": ts,
        "hostname": "node-a",
        "gpu_index": 0,
        "uuid": "GPU-1",
        "pci_bus_id": "00000000:18:00.0",
        "model_name": "NVIDIA H200",
        "driver_version": "570.124.06",
        "mig": None,
        "allocations": [],
        "gpu_lost": False,
        "gpu_temp_c": 60.0,
        "clock_event_reasons": 0,
        "ecc_dbe_volatile_total": 0,
        "row_remap_pending": False,
        "row_remap_failure": False,
        "gpu_recovery_action": 0,
    }
    base.update(kw)
    return base


def signals(tracker: HealthTracker, s: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e.signal, e.kind) for e in tracker.observe(s)[1]]


def test_quiet_gpu_raises_nothing_and_remembers_identity() -> None:
    t = HealthTracker()
    assert signals(t, sample()) == []
    ident = t.identity("node-a", "0000:18:00.0")
    assert ident is not None and ident.uuid == "GPU-1" and ident.gpu_index == 0
    h = t.health("node-a", "0000:18:00.0")
    assert h is not None and h.remap_pending is False and h.ecc_dbe_volatile == 0


def test_dbe_increase_is_an_edge_with_the_delta_and_reset_rebaselines() -> None:
    t = HealthTracker()
    assert signals(t, sample(ecc_dbe_volatile_total=5)) == []  # first sample = baseline
    out = t.observe(sample(T0 + S, ecc_dbe_volatile_total=7))[1]
    assert [(e.signal, e.kind, e.count) for e in out] == [("ecc_dbe", "occurrence", 2)]
    assert signals(t, sample(T0 + 2 * S, ecc_dbe_volatile_total=7)) == []
    # driver reload: re-baselines, and is evidence the GPU was reset (resolves its sticky alerts)
    assert signals(t, sample(T0 + 3 * S, ecc_dbe_volatile_total=0)) == [("gpu_reset", "occurrence")]
    assert signals(t, sample(T0 + 4 * S, ecc_dbe_volatile_total=1)) == [("ecc_dbe", "occurrence")]
    assert signals(t, sample(T0 + 5 * S, ecc_dbe_volatile_total=None)) == []  # not reported: nothing


@pytest.mark.parametrize(
    "field", ["row_remap_pending", "row_remap_failure", "bank_remap_pending", "memory_unrepairable"]
)
def test_level_signals(field: str) -> None:
    t = HealthTracker()
    assert signals(t, sample(**{field: True})) == [(field, "active")]
    assert signals(t, sample(T0 + S, **{field: True})) == [(field, "active")]
    assert signals(t, sample(T0 + 2 * S, **{field: None})) == []
    assert signals(t, sample(T0 + 3 * S, **{field: False})) == [(field, "clear")]
    assert signals(t, sample(T0 + 4 * S, **{field: False})) == []


def test_gpu_lost_edge_then_active() -> None:
    t = HealthTracker()
    assert signals(t, sample()) == []
    assert signals(t, sample(T0 + S // 2, gpu_lost=True)) == [("gpu_lost", "occurrence")]
    assert signals(t, sample(T0 + S, gpu_lost=True)) == [("gpu_lost", "active")]
    assert signals(t, sample(T0 + 2 * S)) == [("gpu_reset", "occurrence")]  # back after being lost
    assert signals(t, sample(T0 + 3 * S, gpu_lost=True)) == [("gpu_lost", "occurrence")]


def test_a_gpu_lost_in_its_first_sample_is_a_baseline() -> None:
    # after a restart the loss may be the one an alert restored open already reports
    t = HealthTracker()
    _ident, (sig,) = t.observe(sample(gpu_lost=True))
    assert (sig.signal, sig.kind, sig.baseline) == ("gpu_lost", "active", True)
    _ident, (sig,) = t.observe(sample(T0 + S, gpu_lost=True))
    assert (sig.kind, sig.baseline) == ("active", False)


def test_thermal_needs_sustained_bits_and_clears_with_hysteresis() -> None:
    t = HealthTracker(HealthConfig(thermal_for_ms=10 * S, thermal_clear_ms=5 * S))
    hot = 0x20 | 0x1
    for i in range(10):
        assert signals(t, sample(T0 + i * S, clock_event_reasons=hot, gpu_temp_c=91.0)) == []
    out = t.observe(sample(T0 + 10 * S, clock_event_reasons=0x40))[1]
    assert [(e.signal, e.kind, e.since_ms) for e in out] == [("thermal", "active", T0)]
    assert signals(t, sample(T0 + 11 * S, clock_event_reasons=0x4)) == []  # cooling down, not yet clear
    assert signals(t, sample(T0 + 12 * S, clock_event_reasons=0x20)) == [("thermal", "active")]  # back
    assert signals(t, sample(T0 + 13 * S, clock_event_reasons=0)) == []
    assert signals(t, sample(T0 + 18 * S, clock_event_reasons=0)) == [("thermal", "clear")]


def test_a_single_cool_sample_restarts_the_thermal_timer() -> None:
    t = HealthTracker(HealthConfig(thermal_for_ms=10 * S))
    for i in range(8):
        signals(t, sample(T0 + i * S, clock_event_reasons=0x20))
    signals(t, sample(T0 + 8 * S, clock_event_reasons=0))
    for i in range(9, 15):
        assert signals(t, sample(T0 + i * S, clock_event_reasons=0x20)) == []


def test_recovery_action_level() -> None:
    t = HealthTracker()
    out = t.observe(sample(gpu_recovery_action=2))[1]
    assert [(e.signal, e.kind, e.value) for e in out] == [("recovery_action", "active", 2)]
    assert signals(t, sample(T0 + S, gpu_recovery_action=0)) == [
        ("gpu_reset", "occurrence"),
        ("recovery_action", "clear"),
    ]


def test_out_of_order_mig_and_broken_samples_are_skipped() -> None:
    t = HealthTracker()
    signals(t, sample(T0 + 10 * S))
    assert signals(t, sample(T0, row_remap_failure=True)) == []  # older than the latest
    mig = {
        "mig_uuid": "MIG-1",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g",
        "slice_fraction": 0.1,
    }
    assert signals(t, sample(T0 + 20 * S, mig=mig, row_remap_failure=True)) == []
    with pytest.raises(InvalidRecord):
        t.observe(sample(T0 + 20 * S, hostname=""))
    with pytest.raises(InvalidRecord):
        t.observe(sample("not-a-time"))  # type: ignore[arg-type]
    assert t.skipped == 4


def test_device_key_forms() -> None:
    assert (
        alert_device_key("00000000:3B:00.0")
        == alert_device_key("0000:3b:00")
        == alert_device_key("PCI:0000:3b:00")
        == "0000:3b:00.0"
    )
    assert alert_device_key("garbage") == "garbage"
    assert alert_device_key("", "GPU-9") == "GPU-9"
