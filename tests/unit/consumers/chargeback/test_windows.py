"""Window engine: bounds, closing, late data, the GPU-seconds invariant, and exact replay recovery."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace

import pytest

from gpupipe.domain.prices import parse_price_table
from gpupipe_consumers.chargeback.accounting import AccountingConfig, account
from gpupipe_consumers.chargeback.errors import (
    ChargebackConfigError,
    ChargebackStateError,
    CheckpointMismatchError,
    GpuCapReached,
)
from gpupipe_consumers.chargeback.windows import Checkpoint, WindowEngine, window_bounds
from gpupipe_schemas.meaning import MIG_SHARED, UNALLOCATED, gpu_key
from tests.synthetic_fleet import FleetRecord, FleetSpec, blank_sample, generate_fleet

H = 3_600_000
MIN = 60_000
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z, a multiple of the hour
PRICES = parse_price_table(
    {
        "currency": "USD",
        "energy_per_kwh": 0.1,
        "default_per_gpu_hour": 1.0,
        "models": [{"match": "NVIDIA H200", "per_gpu_hour": 4.0}],
    }
)


def sample(ts: int, uuid: str = "GPU-a", ns: str | None = "team-a", node: str = "n1", **kw):
    allocations = (
        []
        if ns is None
        else [{"namespace": ns, "pod": "p", "container": "c", "resource_name": None, "replica": None}]
    )
    base = dict(
        timestamp_ms=ts,
        hostname=node,
        gpu_index=0,
        uuid=uuid,
        pci_bus_id="0:1",
        model_name="NVIDIA H200",
        interval_ms=10_000,
        gpu_util_ratio=0.5,
        allocations=allocations,
    )
    base.update(kw)
    return blank_sample(**base)


def engine(**kw) -> WindowEngine:
    kw.setdefault("prices", PRICES)
    return WindowEngine(kw.pop("window_ms", H), kw.pop("grace_ms", 5 * MIN), instance_id="test", **kw)


def feed(e: WindowEngine, samples: Iterable[dict], partition: int = 0, first_offset: int = 0) -> list[dict]:
    out = []
    for i, s in enumerate(samples):
        e.add(s, partition, first_offset + i)
        out += e.poll_closed()
    return out


def totals(
    records: Iterable[dict],
    key: Callable[[dict], tuple] = lambda r: (
        r["window_start_ms"],
        r["namespace"],
        r["node"],
        r["gpu_model"],
    ),
):
    """Sum of the additive fields per key (windows and corrections together)."""
    out: dict[tuple, Counter] = defaultdict(Counter)
    for r in records:
        c = out[key(r)]
        for f in (
            "allocated_gpu_seconds",
            "used_gpu_seconds",
            "idle_gpu_seconds",
            "energy_joules",
            "activity_unknown_gpu_seconds",
            "shared_gpu_seconds",
            "mig_gpu_seconds",
            "lost_gpu_seconds",
            "cost_total",
            "sample_count",
        ):
            c[f] += r[f]
    return dict(out)


def assert_same_totals(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        for f in a[k]:
            assert a[k][f] == pytest.approx(b[k][f], rel=1e-9, abs=1e-6), (k, f)


# -- window bounds --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ts", "window_ms", "bounds"),
    [
        (T0, H, (T0, T0 + H)),
        (T0 + 1, H, (T0, T0 + H)),
        (T0 + H - 1, H, (T0, T0 + H)),
        (T0 + H, H, (T0 + H, T0 + 2 * H)),
        (T0 + 61_000, MIN, (T0 + MIN, T0 + 2 * MIN)),
        (0, H, (0, H)),
        (-1, H, (-H, 0)),  # floor, not truncation
        (T0 + 12 * H, 86_400_000, (T0, T0 + 86_400_000)),
    ],
)
def test_window_bounds(ts, window_ms, bounds):
    assert window_bounds(ts, window_ms) == bounds


@pytest.mark.parametrize("kw", [{"window_ms": 0}, {"grace_ms": -1}])
def test_engine_config_validation(kw):
    with pytest.raises(ChargebackConfigError):
        engine(**kw)


# -- closing --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("watermark_offset_ms", "closed"),
    [(H - 1, False), (H + 5 * MIN - 1, False), (H + 5 * MIN, True), (3 * H, True)],
)
def test_window_closes_at_end_plus_grace(watermark_offset_ms, closed):
    e = engine()
    e.add(sample(T0 + 10_000), 0, 0)
    e.add(sample(T0 + watermark_offset_ms, uuid="GPU-other"), 0, 1)
    out = [r for r in e.poll_closed() if r["window_start_ms"] == T0]
    assert bool(out) == closed
    if closed:
        (r,) = out
        assert (r["kind"], r["namespace"], r["window_end_ms"], r["source_partition"]) == (
            "window",
            "team-a",
            T0 + H,
            0,
        )
        assert r["allocated_gpu_seconds"] == pytest.approx(10.0)


def test_watermarks_are_per_partition():
    e = engine()
    e.add(sample(T0), 0, 0)
    e.add(sample(T0 + 3 * H, uuid="GPU-b"), 1, 0)  # partition 1 races ahead
    assert e.poll_closed() == []  # partition 0's window is still open
    assert e.watermark(0) == T0 and e.watermark(1) == T0 + 3 * H


def test_record_fields_and_costs():
    e = engine()
    feed(
        e, [sample(T0 + i * 10_000, power_w=360.0, gpu_util_ratio=0.0 if i < 90 else 0.8) for i in range(360)]
    )
    (r,) = e.flush_all()
    assert r["allocated_gpu_seconds"] == pytest.approx(3600.0)
    assert r["idle_gpu_seconds"] == pytest.approx(900.0)
    assert r["used_gpu_seconds"] == pytest.approx(270 * 10 * 0.8)
    assert r["energy_joules"] == pytest.approx(360.0 * 3600)
    assert r["sample_count"] == 360
    assert (r["price_per_gpu_hour"], r["price_source"], r["currency"]) == (4.0, "exact", "USD")
    assert r["cost_allocation"] == pytest.approx(4.0)
    assert r["cost_energy"] == pytest.approx(0.36 * 0.1)
    assert r["cost_total"] == pytest.approx(4.036)
    assert r["instance_id"] == "test" and r["team"] is None


def test_unknown_model_is_billed_at_default_price_and_flagged():
    e = engine()
    feed(e, [sample(T0 + i * 10_000, model_name="Acme X1") for i in range(360)])
    (r,) = e.flush_all()
    assert (r["price_source"], r["price_per_gpu_hour"]) == ("default", 1.0)
    assert r["cost_allocation"] == pytest.approx(1.0)


def test_team_mapping_in_engine_is_optional():
    e = engine(team_of=lambda ns: "t-" + ns)
    feed(e, [sample(T0)])
    assert e.flush_all()[0]["team"] == "t-team-a"


def test_one_row_per_namespace_node_and_model():
    e = engine()
    feed(
        e,
        [
            sample(T0, uuid="g1", ns="a", node="n1"),
            sample(T0, uuid="g2", ns="a", node="n1"),
            sample(T0, uuid="g3", ns="a", node="n2"),
            sample(T0, uuid="g4", ns="b", node="n1", model_name="NVIDIA A100"),
            sample(T0, uuid="g5", ns=None, node="n2"),
        ],
    )
    rows = {(r["namespace"], r["node"], r["gpu_model"]): r["allocated_gpu_seconds"] for r in e.flush_all()}
    assert rows == {
        ("a", "n1", "NVIDIA H200"): 20.0,
        ("a", "n2", "NVIDIA H200"): 10.0,
        ("b", "n1", "NVIDIA A100"): 10.0,
        (UNALLOCATED, "n2", "NVIDIA H200"): 10.0,
    }


# -- late data ------------------------------------------------------------------------------------
def test_late_within_grace_is_counted_in_the_window():
    e = engine()
    out = feed(e, [sample(T0 + H - 20_000), sample(T0 + H + 4 * MIN, uuid="GPU-b"), sample(T0 + H - 10_000)])
    assert out == []
    out = feed(e, [sample(T0 + H + 5 * MIN, uuid="GPU-b")], first_offset=3)
    (w,) = [r for r in out if r["window_start_ms"] == T0]
    assert w["kind"] == "window" and w["allocated_gpu_seconds"] == pytest.approx(20.0)
    assert e.stats["late"] == 0


def test_very_late_sample_becomes_a_correction_record():
    e = engine()
    out = feed(e, [sample(T0 + H - 20_000), sample(T0 + H + 6 * MIN, uuid="GPU-b")])
    (w,) = [r for r in out if r["window_start_ms"] == T0]
    assert w["allocated_gpu_seconds"] == pytest.approx(10.0)
    assert feed(e, [sample(T0 + H - 10_000)], first_offset=2) == []  # its run of late records goes on
    assert feed(e, [sample(T0 + H + 7 * MIN, uuid="GPU-b")], first_offset=3) == []  # on time: it goes on
    out = feed(e, [sample(T0 + 2 * H, uuid="GPU-b")], first_offset=4)  # the watermark's next window: it ends
    (c,) = out
    assert (c["kind"], c["window_start_ms"], c["namespace"]) == ("correction", T0, "team-a")
    assert c["allocated_gpu_seconds"] == pytest.approx(10.0)
    assert (c["late_offsets"], c["record_id"].rsplit("|", 1)[1]) == ([2], "2-2")
    assert e.stats["late"] == 1


def test_late_samples_are_grouped_into_one_correction_per_run_whenever_polled():
    """A run of late records is one correction per row, however often it is polled: a
    re-processing run that commits at other moments emits the same records (late_runs.py). On-time
    records among them do not end it; one that moves the watermark into its next window does."""
    for poll_each in (False, True):
        e = engine()
        feed(e, [sample(T0), sample(T0 + 2 * H, uuid="GPU-b")])
        out = []
        for i in range(1, 6):
            e.add(sample(T0 + i * 10_000), 0, 1 + i)
            if poll_each:
                out += e.poll_closed()
        e.add(sample(T0 + 2 * H + 10_000, uuid="GPU-b"), 0, 7)  # on time
        e.add(sample(T0 + 6 * 10_000), 0, 8)  # late again: the same run
        out += e.poll_closed()
        assert [r for r in out if r["kind"] == "correction"] == []
        e.add(sample(T0 + 3 * H, uuid="GPU-b"), 0, 9)  # the watermark's next window: the run ends
        e.add(sample(T0 + 7 * 10_000), 0, 10)  # late again: a new run
        out += e.poll_closed()
        (c,) = [r for r in out if r["kind"] == "correction"]
        assert c["sample_count"] == 6 and c["late_offsets"] == [2, 3, 4, 5, 6, 8]
        (c2,) = [r for r in e.flush_all() if r["kind"] == "correction"]
        assert c2["late_offsets"] == [10]


def test_a_run_of_late_records_ends_after_a_quiet_gap_or_at_an_offset_block():
    e = engine(late_run_gap_ms=60_000)
    feed(e, [sample(T0), sample(T0 + 2 * H, uuid="GPU-b")])
    ts = T0 + 2 * H
    e.add(sample(T0 + 10_000), 0, 2, ts)
    e.add(sample(T0 + 20_000), 0, 3, ts + 59_999)  # not quiet long enough: the same run
    e.add(sample(T0 + 30_000), 0, 4, ts + 59_999 + 60_000)  # after a minute without records
    assert [r["late_offsets"] for r in e.poll_closed()] == [[2, 3]]
    e.add(sample(T0 + 40_000), 0, 9_999, ts + 120_000)
    e.add(sample(T0 + 50_000), 0, 10_000, ts + 120_001)  # another block of offsets
    assert [r["late_offsets"] for r in e.poll_closed()] == [[4, 9_999]]
    assert [r["late_offsets"] for r in e.flush_all() if r["kind"] == "correction"] == [[10_000]]


def test_an_idle_partition_emits_its_pending_run_once_broker_time_is_past_the_gap():
    e = engine(late_run_gap_ms=60_000)
    feed(e, [sample(T0), sample(T0 + 2 * H, uuid="GPU-b")])
    last = T0 + 2 * H + 5_000
    e.add(sample(T0 + 10_000), 0, 2, last)
    assert e.checkpoint(0).late_from == 2
    e.advance_idle(0, last + 60_000 + 29_999)
    assert e.poll_closed() == []  # the next record could still come within the gap
    assert e.advance_idle(0, last + 90_000)
    (c,) = e.poll_closed()
    assert c["late_offsets"] == [2] and e.checkpoint(0).late_from is None


def test_after_flush_all_samples_of_flushed_windows_are_corrections():
    e = engine()
    feed(e, [sample(T0)])
    assert [r["kind"] for r in e.flush_all()] == ["window"]
    feed(e, [sample(T0 + 10_000)], first_offset=1)
    assert [r["kind"] for r in e.flush_all()] == ["correction"]


# -- duplicates, clock, energy through the engine -------------------------------------------------
def test_duplicates_are_counted_once():
    e = engine()
    s = [sample(T0 + i * 10_000) for i in range(10)]
    feed(e, [s[0], s[1], s[1], s[2], s[1], s[3], *s[4:], s[9]])
    (r,) = e.flush_all()
    assert r["allocated_gpu_seconds"] == pytest.approx(100.0)
    assert r["sample_count"] == 10
    assert e.stats["duplicate"] == 3


def test_clock_backwards_never_yields_negative_time():
    e = engine()
    seq = [sample(T0 + 30 * MIN + i * 10_000) for i in range(6)]  # up to +30:50
    seq += [sample(T0 + 10 * MIN + i * 10_000) for i in range(6)]  # clock went back 20 minutes
    feed(e, seq)
    (r,) = e.flush_all()
    # first: 10 s, five continued: 50 s; six backwards samples: their nominal 10 s each
    assert r["allocated_gpu_seconds"] == pytest.approx(120.0)
    assert e.stats["backwards"] == 6


def test_energy_counter_reset_falls_back_to_power():
    e = engine()
    energies = [10_000_000, 13_000_000, 500, 3_000_500]  # reload between the 2nd and 3rd sample
    feed(e, [sample(T0 + i * 10_000, total_energy_mj=en, power_w=200.0) for i, en in enumerate(energies)])
    (r,) = e.flush_all()
    # first: 200 W x 10 s, then 3000 J, reset: 200 W x 10 s, then 3000 J
    assert r["energy_joules"] == pytest.approx(2000 + 3000 + 2000 + 3000)
    assert r["energy_estimated_joules"] == pytest.approx(4000)


def test_energy_counter_missing_uses_power_times_time():
    e = engine()
    feed(e, [sample(T0 + i * 10_000, power_w=150.0) for i in range(6)])
    (r,) = e.flush_all()
    assert r["energy_joules"] == pytest.approx(150.0 * 60)
    assert r["energy_estimated_joules"] == r["energy_joules"]


def test_mig_slices_and_parent():
    e = engine()
    mig = {
        "mig_uuid": "MIG-1",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "3g.40gb",
        "slice_fraction": 3 / 7,
    }
    recs = []
    for i in range(6):
        recs.append(sample(T0 + i * 10_000, ns=None, mig_enabled=True, power_w=210.0, gpu_util_ratio=None))
        recs.append(
            sample(
                T0 + i * 10_000,
                uuid="GPU-a",
                mig=mig,
                mig_enabled=True,
                gpu_util_ratio=None,
                sm_active_ratio=0.5,
            )
        )
    feed(e, recs)
    rows = {r["namespace"]: r for r in e.flush_all()}
    assert rows["team-a"]["allocated_gpu_seconds"] == pytest.approx(60 * 3 / 7)
    assert rows["team-a"]["mig_gpu_seconds"] == pytest.approx(60 * 3 / 7)
    assert rows[MIG_SHARED]["allocated_gpu_seconds"] == 0.0
    assert rows[MIG_SHARED]["energy_joules"] == pytest.approx(210.0 * 60)
    assert UNALLOCATED not in rows  # the MIG-mode whole GPU is not unallocated capacity


# -- the invariant over a synthetic fleet ---------------------------------------------------------
def observed_gpu_seconds(records: list[FleetRecord], cfg: AccountingConfig, window_ms: int = H) -> dict:
    """Reference tally: accounted time x fraction per window, straight from the per-sample rules."""
    refs: dict = {}
    out: Counter = Counter()
    for r in records:
        k = (r.partition, gpu_key(r.sample))
        res = account(r.sample, refs.get(k), r.offset, cfg)
        if res.new_ref is not None:
            refs[k] = res.new_ref
        out[window_bounds(r.sample["timestamp_ms"], window_ms)[0]] += res.observed_gpu_s
    return out


def run_plain(records: list[FleetRecord], poll_every: int = 200, **kw) -> list[dict]:
    e = engine(**kw)
    out = []
    for i, r in enumerate(records):
        e.add(r.sample, r.partition, r.offset)
        if i % poll_every == 0:
            out += e.poll_closed()
    return out + e.flush_all()


@pytest.mark.parametrize(
    "spec",
    [
        FleetSpec(),
        FleetSpec(seed=11, drop_ratio=0.05, duplicate_ratio=0.03, jitter_ms=3000),
        FleetSpec(seed=3, clock_jumps=((1, 40 * MIN, -25 * MIN), (3, 70 * MIN, 30 * MIN))),
    ],
    ids=["default", "lossy", "clock-jumps"],
)
def test_sum_over_namespaces_equals_observed_gpu_seconds(spec):
    records = generate_fleet(spec)
    out = run_plain(records)
    per_window = Counter()
    for r in out:
        per_window[r["window_start_ms"]] += r["allocated_gpu_seconds"]
    expected = observed_gpu_seconds(records, AccountingConfig())
    assert per_window.keys() == expected.keys()
    for w in expected:
        assert per_window[w] == pytest.approx(expected[w], rel=1e-12)
    kinds = Counter(r["kind"] for r in out)
    assert kinds["window"] > 0
    if spec.late:
        assert kinds["correction"] > 0  # the fleet has a node beyond grace: nothing was dropped
    namespaces = {r["namespace"] for r in out}
    assert {UNALLOCATED, MIG_SHARED} <= namespaces
    for r in out:  # the breakdowns are parts of the allocated time
        assert r["used_gpu_seconds"] <= r["allocated_gpu_seconds"] + 1e-9
        assert r["idle_gpu_seconds"] + r["activity_unknown_gpu_seconds"] <= r["allocated_gpu_seconds"] + 1e-9
        assert r["lost_gpu_seconds"] == 0.0 or r["namespace"] == UNALLOCATED


def test_clean_fleet_bills_exactly_samples_times_interval():
    spec = FleetSpec(jitter_ms=0, drop_ratio=0.0, duplicate_ratio=0.0, late=(), lost=False)
    records = generate_fleet(spec)
    out = run_plain(records)
    expected = 0.0
    for r in records:
        mig = r.sample["mig"]
        expected += 10.0 * (mig["slice_fraction"] if mig else (0.0 if r.sample["mig_enabled"] else 1.0))
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(expected, rel=1e-12)
    # 16 whole GPUs + 2 shared + 2 MIG GPUs at 6/7 configured, for 2 hours
    assert expected == pytest.approx((18 + 2 * 6 / 7) * 2 * 3600)
    assert all(r["kind"] == "window" for r in out)


# -- recovery -------------------------------------------------------------------------------------
class Cluster:
    """A fake consumer group over in-memory partition logs, with transactional commits.

    Each ``step`` delivers the next ``batch`` records (in arrival order over the assigned partitions)
    to their owners, then every owner polls, checkpoints and commits: the produced records and the
    committed offsets + metadata become visible together, or (``abort``) not at all.
    """

    def __init__(self, records: list[FleetRecord], make: Callable[[], WindowEngine]) -> None:
        self.logs: dict[int, list[FleetRecord]] = defaultdict(list)
        for r in records:
            self.logs[r.partition].append(r)
        self.make = make
        self.committed: dict[int, tuple[int, str]] = {}
        self.output: list[dict] = []
        self.position = dict.fromkeys(self.logs, 0)
        self.owner: dict[int, WindowEngine] = {}

    def assign(self, partition: int, eng: WindowEngine) -> None:
        prev = self.owner.get(partition)
        if prev is not None and prev is not eng:
            prev.drop_partition(partition)  # revoked after its last commit
        self.owner[partition] = eng
        offset, meta = self.committed.get(partition, (0, ""))
        eng.restore(partition, Checkpoint.from_metadata(offset, meta))
        self.position[partition] = offset

    def restart(self, eng: WindowEngine) -> WindowEngine:
        new = self.make()
        for p in [p for p, o in self.owner.items() if o is eng]:
            self.owner[p] = new
            offset, meta = self.committed.get(p, (0, ""))
            new.restore(p, Checkpoint.from_metadata(offset, meta))
            self.position[p] = offset
        return new

    def done(self) -> bool:
        return all(self.position[p] >= len(log) for p, log in self.logs.items())

    def rollback(self, position: dict[int, int]) -> None:
        """Undo the last step's commit (as if its transaction had aborted)."""
        n, committed = self._before
        del self.output[n:]
        self.committed = committed
        self.position.update(position)

    def step(self, batch: int, abort: bool = False) -> None:
        self._before = (len(self.output), dict(self.committed))
        for _ in range(batch):
            live = [p for p in self.logs if self.position[p] < len(self.logs[p])]
            if not live:
                break
            p = min(live, key=lambda q: (self.logs[q][self.position[q]].arrival_ms, q))
            rec = self.logs[p][self.position[p]]
            self.owner[p].add(rec.sample, p, rec.offset)
            self.position[p] += 1
        pending, offsets = [], {}
        for eng in {id(e): e for e in self.owner.values()}.values():
            pending += eng.poll_closed()
            for p in [p for p, o in self.owner.items() if o is eng]:
                cp = eng.checkpoint(p, next_offset=self.position[p])
                if cp is not None:
                    offsets[p] = (cp.offset, cp.to_metadata())
        if not abort:
            self.output += pending
            self.committed.update(offsets)

    def finish(self) -> None:
        for eng in {id(e): e for e in self.owner.values()}.values():
            self.output += eng.flush_all()


def window_emissions(records: list[dict]) -> Counter:
    return Counter(
        (r["source_partition"], r["window_start_ms"], r["namespace"], r["node"], r["gpu_model"])
        for r in records
        if r["kind"] == "window"
    )


NASTY = FleetSpec(
    seed=5,
    gpus=12,
    hours=3.0,
    drop_ratio=0.04,
    duplicate_ratio=0.04,
    jitter_ms=2500,
    clock_jumps=((1, 50 * MIN, -30 * MIN), (2, 100 * MIN, -3 * MIN)),
)


@pytest.mark.parametrize(
    ("spec", "batch", "crash_every", "abort"),
    [
        (FleetSpec(), 97, 1500, False),  # crash right after a commit
        (FleetSpec(), 97, 1500, True),  # crash with a batch processed but its transaction aborted
        (FleetSpec(seed=2), 500, 2500, True),
        (NASTY, 61, 1000, False),  # duplicates, gaps, jitter and clocks jumping back around replay starts
        (NASTY, 61, 777, True),
    ],
    ids=["commit-crash", "abort-crash", "big-batches", "nasty-commit", "nasty-abort"],
)
def test_crash_and_replay_neither_loses_nor_double_counts(spec, batch, crash_every, abort):
    """Crash every ``crash_every`` records of progress (replays re-read up to an hour of records)."""
    records = generate_fleet(spec)
    baseline = run_plain(records)

    cluster = Cluster(records, engine)
    eng = engine()
    for p in sorted(cluster.logs):
        cluster.assign(p, eng)
    high = dict(cluster.position)
    next_crash, crashes = crash_every, 0
    while not cluster.done():
        before = dict(cluster.position)
        cluster.step(batch)
        high = {p: max(high[p], cluster.position[p]) for p in high}
        if sum(high.values()) >= next_crash:
            next_crash += crash_every
            if abort:  # the batch was processed, but its transaction never committed
                cluster.rollback(before)
            eng = cluster.restart(eng)
            crashes += 1
    cluster.finish()

    assert crashes > 3
    assert_same_totals(totals(cluster.output), totals(baseline))
    assert max(window_emissions(cluster.output).values()) == 1  # no window emitted twice
    assert sum(1 for r in cluster.output if r["kind"] == "window") == sum(
        1 for r in baseline if r["kind"] == "window"
    )


def test_replay_skips_what_was_committed_and_reports_it():
    cluster = Cluster(generate_fleet(FleetSpec(gpus=8, hours=1.5, late=())), engine)
    eng = engine()
    for p in sorted(cluster.logs):
        cluster.assign(p, eng)
    while cluster.output == []:  # until the first window closed and was committed
        cluster.step(50)
    eng = cluster.restart(eng)
    replays = [p for p in cluster.logs if eng.is_replay(p, cluster.position[p])]
    assert replays  # the committed offsets are behind the positions: open windows get replayed
    while not cluster.done():
        cluster.step(50)
    assert eng.stats["replay_skipped"] > 0  # samples of the emitted window, replayed for GPU state only


def test_rebalance_moves_partitions_between_instances():
    records = generate_fleet(FleetSpec(seed=9))
    baseline = run_plain(records)
    a, b = engine(), engine()
    cluster = Cluster(records, engine)
    parts = sorted(cluster.logs)
    for p in parts:
        cluster.assign(p, a if p % 2 == 0 else b)
    steps = 0
    while not cluster.done():
        steps += 1
        cluster.step(101)
        if steps == 40:
            cluster.assign(parts[0], b)  # a -> b
        if steps == 90:
            cluster.assign(parts[1], a)  # b -> a
            cluster.assign(parts[0], a)  # and back
    cluster.finish()
    assert_same_totals(totals(cluster.output), totals(baseline))
    assert max(window_emissions(cluster.output).values()) == 1


def test_two_instances_with_half_the_partitions_each_sum_to_one_instance():
    records = generate_fleet(FleetSpec(seed=4))
    one = run_plain(records)
    halves = [run_plain([r for r in records if r.partition % 2 == k]) for k in (0, 1)]
    key = lambda r: (r["window_start_ms"], r["namespace"], r["node"], r["gpu_model"])  # noqa: E731
    assert_same_totals(totals(halves[0] + halves[1], key), totals(one, key))
    assert {r["source_partition"] for r in halves[0]}.isdisjoint({r["source_partition"] for r in halves[1]})


# -- checkpoint protocol --------------------------------------------------------------------------
def test_checkpoint_offset_is_the_oldest_offset_open_state_depends_on():
    e = engine()
    feed(
        e,
        [
            sample(T0 + H - 10_000, uuid="g1"),  # offset 0: window 0
            sample(T0 + H + 10_000, uuid="g2"),  # offset 1: window 1
            sample(T0 + H, uuid="g1"),  # offset 2: window 1, measured from offset 0
            sample(T0 + H + 10 * MIN, uuid="g3"),
        ],
    )  # offset 3: closes window 0
    assert e.open_window_starts(0) == (T0 + H,)
    # g1's sample in window 1 was measured against offset 0 (in a closed window): replay must start there
    assert e.open_windows_min_offset(0) == 0
    cp = e.checkpoint(0)
    assert (cp.offset, cp.watermark_ms, cp.replay_until) == (0, T0 + H + 10 * MIN, 4)
    assert e.open_windows_min_offset(7) is None
    assert e.checkpoint(7) is None


def test_stale_gpu_state_is_forgotten_and_the_checkpoint_moves_on():
    e = engine()
    feed(e, [sample(T0, uuid="gone")])
    out = feed(e, [sample(T0 + 3 * H + i * 10_000, uuid="stays") for i in range(3)], first_offset=1)
    assert [r["window_start_ms"] for r in out] == [T0]
    cp = e.checkpoint(0)
    assert cp.offset == 1  # "gone" is stale: no later sample can be measured against it
    assert e.gpu_count(0) == 1


def test_checkpoint_requires_polling_first():
    e = engine()
    feed(e, [sample(T0), sample(T0 + 2 * H, uuid="GPU-b")])
    e.add(sample(T0 + 10_000), 0, 2)  # late: a run of late records is pending; it is state
    assert e.checkpoint(0) is not None
    e.add(sample(T0 + 3 * H, uuid="GPU-b"), 0, 3)  # the watermark's next window: the run ended
    with pytest.raises(ChargebackStateError):
        e.checkpoint(0)
    e.poll_closed()
    assert e.checkpoint(0) is not None


def test_checkpoint_metadata_round_trip():
    cp = Checkpoint(offset=17, watermark_ms=T0, replay_until=42, window_ms=H, grace_ms=5 * MIN)
    meta = cp.to_metadata()
    assert len(meta) < 200
    assert Checkpoint.from_metadata(17, meta) == cp
    full = replace(cp, late_from=20, writer="chargeback-0")
    assert Checkpoint.from_metadata(17, full.to_metadata()) == full
    assert Checkpoint.from_metadata(17, replace(cp, watermark_ms=None).to_metadata()).watermark_ms is None


@pytest.mark.parametrize(
    "meta",
    [
        None,
        "",
        "x",
        "[]",
        '{"t":"other","v":1}',
        '{"t":"gpupipe-chargeback","v":9}',
        '{"t":"gpupipe-chargeback","v":1,"wm":1}',
    ],
)
def test_foreign_metadata_means_start_fresh(meta):
    assert Checkpoint.from_metadata(5, meta) is None


def test_restore_refuses_other_window_settings():
    cp = Checkpoint(offset=0, watermark_ms=T0, replay_until=3, window_ms=H, grace_ms=5 * MIN)
    with pytest.raises(CheckpointMismatchError):
        engine(window_ms=15 * MIN).restore(0, cp)


def test_checkpoint_during_replay_keeps_the_restored_one():
    cp = Checkpoint(offset=0, watermark_ms=T0 + 20_000, replay_until=3, window_ms=H, grace_ms=5 * MIN)
    e = engine()
    e.restore(0, cp)
    e.add(sample(T0), 0, 0)
    assert e.is_replay(0, 1) and not e.is_replay(0, 3)
    now = e.checkpoint(0)
    assert now is not None and now.prices == e.price_fingerprint  # this instance's prices (D6)
    assert now.writer == "test"  # and its name, for an instance held by them
    assert dataclasses.replace(now, prices=None, writer=None) == cp  # a crash now replays from the same place
    e.add(sample(T0 + 10_000), 0, 1)
    e.add(sample(T0 + 20_000), 0, 2)
    assert e.checkpoint(0).replay_until == 3


def test_drop_partition_forgets_it():
    e = engine()
    feed(e, [sample(T0)], partition=3)
    e.drop_partition(3)
    assert e.partitions() == () and e.flush_all() == []


def test_deterministic_output():
    records = generate_fleet(FleetSpec(seed=8, gpus=8))
    assert run_plain(records) == run_plain(records)


@pytest.mark.parametrize(
    ("sample_ts", "clamped"),
    [
        (T0 + 10 * MIN, False),
        (T0 + 25 * MIN, False),  # exactly the allowed skew
        (T0 + 25 * MIN + 1, True),
        (T0 + 70 * MIN, True),  # would have opened the next window
        (T0 + 365 * 24 * H, True),  # would have closed every window and pinned the checkpoint for a year
    ],
)
def test_a_clock_far_ahead_of_the_record_timestamp_is_not_trusted(sample_ts, clamped):
    e = engine(max_clock_skew_ms=15 * MIN)
    e.add(sample(sample_ts), 0, 0, record_ts_ms=T0 + 10 * MIN)
    assert e.watermark(0) == (T0 + 10 * MIN if clamped else sample_ts)
    (r,) = e.flush_all()
    assert r["window_start_ms"] == T0
    assert e.stats["clock_ahead"] == int(clamped)


def test_clock_skew_guard_is_off_without_record_timestamps():
    e = engine(max_clock_skew_ms=0)
    e.add(sample(T0 + 5 * H), 0, 0)
    assert e.watermark(0) == T0 + 5 * H


def test_made_up_gpus_past_max_gpus_are_refused_and_the_held_ones_billed_exactly() -> None:
    """Samples for made-up UUIDs grew the engine with no cap. Past ``max_gpus`` a new
    GPU's sample is refused (the service dead-letters it), never a held GPU's."""
    real = [sample(T0 + k * 10_000, uuid="GPU-real") for k in range(400)]
    capped, alone = engine(max_gpus=50), engine()
    refused, offset = 0, 0
    for k, s in enumerate(real):
        for j in range(5):  # five made-up GPUs per real sample: 2000 in all
            offset += 1
            try:
                capped.add(sample(s["timestamp_ms"], uuid=f"GPU-forged-{k}-{j}", node=f"f{k}"), 0, offset)
            except GpuCapReached:
                refused += 1
        offset += 1
        capped.add(s, 0, offset)
        alone.add(s, 0, k)
    assert capped.gpu_count(0) <= 50 and refused == 2000 - 49
    assert capped.stats["gpu_cap"] == refused
    billed = [r for r in capped.flush_all() if r["node"] == "n1"]
    assert totals(billed) == totals(alone.flush_all())


def test_stale_gpus_make_room_for_new_ones_and_a_replay_never_refuses() -> None:
    e = engine(max_gpus=2)
    e.add(sample(T0, uuid="GPU-1"), 0, 0)
    e.add(sample(T0, uuid="GPU-2"), 0, 1)
    with pytest.raises(GpuCapReached):
        e.add(sample(T0 + 10_000, uuid="GPU-3"), 0, 2)
    e.add(sample(T0 + 3 * H, uuid="GPU-1"), 0, 3)  # GPU-2's reference is stale by now
    e.add(sample(T0 + 3 * H, uuid="GPU-3"), 0, 4)
    assert e.gpu_count(0) == 2
    # a restored partition replays below its position: what was held before is rebuilt, never refused
    r = engine(max_gpus=1)
    r.restore(0, Checkpoint(0, T0, 3, H, 5 * MIN, None))
    for off, uuid in enumerate(("GPU-1", "GPU-2", "GPU-3")):
        r.add(sample(T0, uuid=uuid), 0, off)
    assert r.gpu_count(0) == 3
