"""Idle detection and right-sizing: crafted samples with exact expected records."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe_consumers.recommend.detector import DetectorConfig, IdleDetector
from gpupipe_consumers.recommend.rightsize import GIB, RightSizeConfig, suggest

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


def test_restart_continues_open_recommendations_from_the_topic() -> None:
    samples = [sample(i * MIN, 0.0) for i in range(60)] + [sample(60 * MIN, 0.9)]
    whole = feed(detector(), samples)
    first = feed(detector(), samples[:45])
    again = detector()
    assert again.restore(first) == 1  # the open one, from its revisions on the topic
    rest = feed(again, samples[45:])
    assert [(r["status"], r["sequence"]) for r in first + rest] == [
        (r["status"], r["sequence"]) for r in whole
    ]
    assert rest[-1]["recommendation_id"] == whole[-1]["recommendation_id"]
    assert rest[-1]["idle_seconds"] == whole[-1]["idle_seconds"] == 3600.0
    # A restored recommendation whose GPU never comes back is resolved as gone.
    lost = detector()
    lost.restore(first)
    feed(lost, [sample(50 * MIN + i * MIN, 0.5, uuid="GPU-9", pods=(("x", "y"),)) for i in range(10)])
    (gone,) = lost.expire()
    assert (gone["status"], gone["resolve_reason"], gone["sequence"]) == (
        "resolved",
        "gone",
        first[-1]["sequence"] + 1,
    )


def test_an_idle_hpc_job_is_recommended_with_its_owner() -> None:
    from gpupipe_producer.podmeta.hpc_jobs import job_allocation

    det = detector()
    recs = []
    for i in range(31):
        s = sample(i * MIN, 0.0, pods=())
        s["allocations"] = [job_allocation("4242")]
        recs += det.observe(s)
    (rec,) = recs
    assert (rec["namespace"], rec["pod"], rec["owner_kind"], rec["owner_name"]) == (
        "hpc",
        "4242",
        "HpcJob",
        "4242",
    )


def test_service_publishes_dead_letters_wrong_types_and_exposes_series() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpupipe_consumers.plumbing.consume_loop import InRecord
    from gpupipe_consumers.recommend.handler import RecommendHandler, am_shape

    class Sink:
        def __init__(self) -> None:
            self.sent: list[dict] = []
            self.flushed_at: list[int] = []

        def send(self, rec: dict) -> None:
            self.sent.append(rec)

        def flush(self) -> None:
            self.flushed_at.append(len(self.sent))

    class Am:
        def __init__(self) -> None:
            self.alerts: list[dict] = []

        def update(self, rec: dict) -> None:
            self.alerts.append(rec)

    reg, sink, am = CollectorRegistry(), Sink(), Am()
    svc = RecommendHandler(detector(), sink, reg, am)
    recs = [InRecord("s", 0, i, None, "GpuSample", sample(i * MIN, 0.0), 0) for i in range(31)]
    bad = [
        InRecord("s", 0, 99, None, "XidEvent", {}, 0),
        InRecord("s", 0, 100, None, "GpuSample", {"x": 1}, 0),
    ]
    rejected = svc.handle(recs + bad)
    assert [(r[0].offset, r[1]) for r in rejected] == [(99, "wrong_record_type"), (100, "invalid_sample")]
    assert len(sink.sent) == 1 and len(svc.open) == 1
    assert sink.flushed_at == [1]  # delivered before the batch's offsets are stored
    text = generate_latest(reg).decode()
    assert 'gpupipe_recommendations_open{action="right_size_mig"} 1.0' in text
    assert "gpupipe_recommendation_cost_wasted{" in text and 'pod="nb-1"' in text
    (alert,) = am.alerts
    state = am_shape(alert)
    assert (state.labels["alertname"], state.labels["severity"], state.status) == (
        "GpuIdleRecommendation",
        "info",
        "firing",
    )
    labels = am_shape(sink.sent[0]).labels
    assert labels["severity"] == "info" and labels["pod"] == "nb-1" and labels["namespace"] == "notebooks"
    assert "1g.10gb" in am_shape(sink.sent[0]).annotations["description"]
    svc.handle([InRecord("s", 0, 200, None, "GpuSample", sample(31 * MIN, 0.9), 0)])
    assert svc.open == {} and "gpupipe_recommendation_cost_wasted{" not in generate_latest(reg).decode()


def test_series_team_is_the_namespace_without_a_rule_as_chargeback_for_the_dashboards() -> None:
    """The Chargeback dashboard filters chargeback's counters and these series by one ``$team``:
    chargeback labels an unmapped namespace's team with the namespace, so must recommend."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpupipe_consumers.plumbing.consume_loop import InRecord
    from gpupipe_consumers.recommend.handler import RecommendHandler

    class Sink:
        def send(self, rec: dict) -> None:
            pass

        def flush(self) -> None:
            pass

    def teams_of(team_of: Any) -> dict[str, str]:
        det = detector()
        det.team_of = team_of
        reg = CollectorRegistry()
        svc = RecommendHandler(det, Sink(), reg)
        pods = (("notebooks", "nb-1"), ("research", "nb-2"))
        idle = [sample(i * MIN, 0.0, pods=pods) for i in range(31)]
        svc.handle([InRecord("s", 0, i, None, "GpuSample", s, 0) for i, s in enumerate(idle)])
        fams = text_string_to_metric_families(generate_latest(reg).decode())
        fam = next(f for f in fams if f.name == "gpupipe_recommendation_cost_wasted")
        return {s.labels["pod"]: s.labels["team"] for s in fam.samples}

    assert teams_of(lambda _ns, _labels: None) == {"nb-1": "notebooks", "nb-2": "research"}
    assert teams_of(lambda ns, _labels: "lab" if ns == "research" else None) == {
        "nb-1": "notebooks",
        "nb-2": "lab",
    }


def test_a_flood_of_made_up_gpus_stays_under_max_gpus_and_a_new_gpu_is_still_tracked() -> None:
    det = IdleDetector(DetectorConfig(max_gpus=50), gpu_price=PRICES.get)
    for i in range(5000):  # the review's flood, scaled down: one sample per made-up GPU and model
        det.observe(sample(MIN, 0.0, uuid=f"GPU-forged-{i}", model_name=f"forged-{i}"))
    assert len(det.tracks) <= 50 and len(det.models_seen) <= 64
    assert det.evicted == 5000 - 50
    # a real GPU sampled after the flood is tracked and, idle long enough, recommended
    out = [r for m in range(1, 200) for r in det.observe(sample(MIN * m, 0.0, uuid="GPU-real"))]
    assert [r["status"] for r in out if r["uuid"] == "GPU-real"][:1] == ["firing"]


def test_an_evicted_gpus_open_recommendation_ends_gone() -> None:
    det = IdleDetector(DetectorConfig(max_gpus=1), gpu_price=PRICES.get)
    fired = [r for m in range(1, 200) for r in det.observe(sample(MIN * m, 0.0))]
    assert fired and fired[0]["status"] == "firing"
    out = det.observe(sample(MIN * 200, 0.0, uuid="GPU-2"))
    assert [(r["uuid"], r["status"], r["resolve_reason"]) for r in out] == [("GPU-1", "resolved", "gone")]
