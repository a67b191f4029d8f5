"""Idle detection and right-sizing: crafted samples with exact expected records."""

from __future__ import annotations

from typing import Any

import pytest

from consumers.recommend.detector import DetectorConfig, IdleDetector
from consumers.recommend.rightsize import GIB, RightSizeConfig, suggest

MIN = 60_000
H100 = "NVIDIA H100 80GB HBM3"
PRICES = {H100: 3.4, "NVIDIA L40S": 1.1, "NVIDIA H200": 4.1}


def sample(ts: int, util: float, *, pods=(("notebooks", "nb-1"),), mem: int = 4 * GIB, **kw: Any) -> dict:
    rec = {
        "timestamp_ms": ts,
        "hostname": "node-a",
        "gpu_index": 0,
        "uuid": "GPU-1",
        "model_name": H100,
        "mig": None,
        "mig_enabled": False,
        "gpu_lost": False,
        "interval_ms": MIN,
        "sm_active_ratio": util,
        "gpu_util_ratio": util,
        "fb_used_bytes": mem,
        "fb_total_bytes": 80 * GIB,
        "processes": [],
        "allocations": [
            {
                "namespace": ns,
                "pod": p,
                "container": "main",
                "resource_name": "nvidia.com/gpu",
                "replica": None,
            }
            for ns, p in pods
        ],
    }
    rec.update(kw)
    return rec


def detector(**kw: Any) -> IdleDetector:
    cfg = DetectorConfig(idle_after_ms=30 * MIN, update_interval_ms=10 * MIN, gone_after_ms=5 * MIN, **kw)
    return IdleDetector(cfg, gpu_price=lambda m: PRICES.get(m, 2.5))


def feed(det: IdleDetector, samples: list[dict]) -> list[dict]:
    out = []
    for s in samples:
        out.extend(det.observe(s))
    return out


def test_fires_after_idle_after_updates_and_resolves_when_busy() -> None:
    det = detector()
    recs = feed(det, [sample(i * MIN, 0.01) for i in range(45)] + [sample(45 * MIN, 0.9)])
    assert [(r["status"], r["sequence"]) for r in recs] == [
        ("firing", 1),
        ("firing", 2),
        ("resolved", 3),
    ]
    first, last = recs[0], recs[-1]
    # 30 samples of 1 min: idle_after reached at the sample of minute 29 (29 min + its interval).
    assert first["timestamp_ms"] == 29 * MIN and first["idle_seconds"] == 1800.0
    assert first["gpu_hours_idle"] == 0.5 and first["cost_wasted"] == pytest.approx(1.7)
    assert recs[1]["timestamp_ms"] == 39 * MIN
    assert last["resolve_reason"] == "busy" and last["idle_seconds"] == 45 * 60.0
    assert last["cost_wasted"] == pytest.approx(0.75 * 3.4)
    assert len({r["recommendation_id"] for r in recs}) == 1
    # 4 GiB peak x 1.2 fits 1g.10gb on an H100: 1/7 of its price.
    assert first["action"] == "right_size_mig" and first["target"] == "1g.10gb"
    assert first["saving_per_hour"] == pytest.approx(3.4 - 3.4 / 7)
    assert "notebooks/nb-1" in first["message"] and "1g.10gb" in first["message"]


def test_busy_pod_never_fires_and_short_streaks_do_not_either() -> None:
    det = detector()
    busy = [sample(i * MIN, 0.9 if i % 20 == 0 else 0.01) for i in range(120)]
    assert feed(det, busy) == []


def test_pod_end_and_silence_resolve() -> None:
    det = detector()
    recs = feed(det, [sample(i * MIN, 0.0) for i in range(31)] + [sample(31 * MIN, 0.0, pods=())])
    assert [r["status"] for r in recs] == ["firing", "resolved"]
    assert recs[-1]["resolve_reason"] == "pod_ended"

    det = detector()
    recs = feed(det, [sample(i * MIN, 0.0) for i in range(31)])
    other = sample(40 * MIN, 0.5, uuid="GPU-2", pods=(("x", "y"),))
    assert det.observe(other) == []
    gone = det.expire()
    assert [(r["status"], r["resolve_reason"], r["timestamp_ms"]) for r in gone] == [
        ("resolved", "gone", 30 * MIN)
    ]
    assert det.open_recommendations() == []


def test_shared_gpu_uses_each_pods_own_processes() -> None:
    det = detector()
    pods = (("a", "busy"), ("b", "idle"))
    procs = [
        {"pid": 1, "namespace": "a", "pod": "busy", "sm_util_ratio": 0.6, "used_memory_bytes": 20 * GIB},
        {"pid": 2, "namespace": "b", "pod": "idle", "sm_util_ratio": 0.0, "used_memory_bytes": 2 * GIB},
    ]
    recs = feed(det, [sample(i * MIN, 0.6, pods=pods, processes=procs, mem=22 * GIB) for i in range(31)])
    assert [(r["namespace"], r["pod"]) for r in recs] == [("b", "idle")]
    assert recs[0]["gpu_fraction"] == 0.5 and recs[0]["memory_peak_bytes"] == 2 * GIB


def test_release_when_memory_never_used_and_labels_owner_team_pass_through() -> None:
    det = IdleDetector(
        DetectorConfig(idle_after_ms=5 * MIN),
        gpu_price=lambda m: 2.0,
        team_of=lambda ns, labels: labels.get("team"),
    )
    s = [sample(i * MIN, 0.0, mem=300 * 1024**2) for i in range(6)]
    for x in s:
        x["allocations"][0].update(owner_kind="StatefulSet", owner_name="nb", labels={"team": "ds"})
    (rec,) = feed(det, s)
    assert rec["action"] == "release" and rec["target"] is None
    assert (rec["owner_kind"], rec["owner_name"], rec["team"], rec["labels"]) == (
        "StatefulSet",
        "nb",
        "ds",
        {"team": "ds"},
    )


def test_suggest_picks_the_cheapest_fitting_option() -> None:
    def price(m: str) -> float:
        return PRICES.get(m, 2.5)

    # L40S is not MIG-capable: 10 GiB fits a quarter of its 48 GiB -> shared replica.
    s = suggest(
        model="NVIDIA L40S", fraction=1, memory_peak_bytes=8 * GIB, activity_peak=0.0, gpu_price=price
    )
    assert (s.action, s.target) == ("shared_gpu", "nvidia.com/gpu.shared")
    # 60 GiB on an H200 (x1.2 = 72 GiB) does not fit 3g.71gb: 7g... none smaller -> L40S? too small.
    s = suggest(
        model="NVIDIA H200",
        fraction=1,
        memory_peak_bytes=60 * GIB,
        activity_peak=0.0,
        gpu_price=price,
        candidate_models=[H100, "NVIDIA L40S"],
    )
    assert (s.action, s.target) == ("cheaper_model", H100)
    # Needs a 3g slice's compute: 0.4 of a whole GPU -> 3 sevenths.
    s = suggest(model=H100, fraction=1, memory_peak_bytes=2 * GIB, activity_peak=0.04 * 10, gpu_price=price)
    assert (s.action, s.target) == ("right_size_mig", "3g.40gb")
    s = suggest(
        model=H100,
        fraction=1,
        memory_peak_bytes=2 * GIB,
        activity_peak=0.0,
        gpu_price=price,
        cfg=RightSizeConfig(release_memory_bytes=4 * GIB),
    )
    assert s.action == "release" and s.saving_per_hour == pytest.approx(3.4)
