"""The contract's bounds refuse the impossible values a node can write, and nothing a fleet sends."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.validate import MAX_LABELS, violation

NOW = 1_795_000_000_000


def _fleet(ticks: int = 30) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    fleet = SimulatedFleet(FleetConfig(nodes=4, gpus_per_node=8))
    samples, xids = [], []
    for k in range(ticks):
        s, x = fleet.tick(NOW + k * 1000)
        samples += s
        xids += x
    return samples, xids


def test_a_simulated_fleet_is_within_every_bound() -> None:
    samples, xids = _fleet()
    assert samples
    assert [violation("GpuSample", s, NOW, NOW) for s in samples] == [None] * len(samples)
    assert [violation("XidEvent", x, NOW, NOW) for x in xids] == [None] * len(xids)


SAMPLE_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "ts-min": ({"timestamp_ms": -(2**63)}, "timestamp_ms"),
    "ts-ancient": ({"timestamp_ms": -(10**15)}, "timestamp_ms"),
    "ts-2100": ({"timestamp_ms": 4_102_444_800_000}, "timestamp_ms"),
    "power-nan": ({"power_w": float("nan")}, "power_w"),
    "power-inf": ({"power_w": float("inf")}, "power_w"),
    "power-huge": ({"power_w": 1e300}, "power_w"),
    "power-over-limit": ({"power_w": 5000.0, "power_limit_w": 700.0}, "power_w"),
    "util-huge": ({"gpu_util_ratio": 1e300}, "gpu_util_ratio"),
    "util-nan": ({"sm_active_ratio": float("nan")}, "sm_active_ratio"),
    "mig-nan": ({"mig": {"slice_fraction": float("nan")}}, "mig.slice_fraction"),
    "temp-absurd": ({"gpu_temp_c": 1e9}, "gpu_temp_c"),
    "energy-negative": ({"total_energy_mj": -5}, "total_energy_mj"),
    "host-long": ({"hostname": "h" * 300}, "hostname"),
    "last-xid": ({"last_xid": 2**31 - 1}, "last_xid"),
}


@pytest.mark.parametrize("case", sorted(SAMPLE_CASES))
def test_a_hostile_sample_names_its_field_and_bound(case: str) -> None:
    change, field = SAMPLE_CASES[case]
    sample = copy.deepcopy(_fleet(1)[0][0])
    for k, v in change.items():
        sample[k] = {**(sample.get(k) or {}), **v} if isinstance(v, dict) else v
    bad = violation("GpuSample", sample, NOW, NOW)
    assert bad is not None and bad.startswith(field + ":"), bad


def test_strings_past_kubernetes_limits_are_refused() -> None:
    sample = copy.deepcopy(_fleet(1)[0][0])
    sample["allocations"] = [{"namespace": "n" * 200_000, "pod": "p", "container": "c", "labels": {}}]
    assert (violation("GpuSample", sample, NOW, NOW) or "").startswith("allocations[0].namespace:")
    sample["allocations"] = [{"namespace": "ns", "pod": "p", "labels": {"k": "v" * 64}}]
    assert "labels" in (violation("GpuSample", sample, NOW, NOW) or "")


def test_labels_per_allocation_are_bounded_in_number() -> None:
    sample = copy.deepcopy(_fleet(1)[0][0])
    labels = {f"l{i}": "v" for i in range(MAX_LABELS)}
    sample["allocations"] = [{"namespace": "ns", "pod": "p", "labels": labels}]
    assert violation("GpuSample", sample, NOW, NOW) is None
    sample["allocations"][0]["labels"] = {**labels, "one-more": "v"}
    bad = violation("GpuSample", sample, NOW, NOW) or ""
    assert bad == f"allocations[0].labels: {MAX_LABELS + 1} entries, at most {MAX_LABELS}"


@pytest.mark.parametrize("code", [-1, 65_536, 2**31 - 1])
def test_an_xid_code_outside_nvidias_range_is_refused(code: int) -> None:
    xid = {"event_id": "e", "timestamp_ms": NOW, "hostname": "h", "kind": "xid", "xid": code}
    assert (violation("XidEvent", xid, NOW, NOW) or "").startswith("xid:")
    for known in (0, 79, 4242, 10001):  # unknown-to-us and NVSwitch SXid codes are codes too
        assert violation("XidEvent", {**xid, "xid": known}, NOW, NOW) is None


def test_a_node_clock_off_by_hours_is_still_accepted() -> None:
    sample = copy.deepcopy(_fleet(1)[0][0])
    for off in (-3 * 3_600_000, 3 * 3_600_000, -30 * 86_400_000):
        sample["timestamp_ms"] = NOW + off
        assert violation("GpuSample", sample, NOW, NOW) is None, off
