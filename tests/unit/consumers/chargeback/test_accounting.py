"""Per-sample accounting rules (consumers/chargeback/accounting.py)."""

from __future__ import annotations

import pytest

from gpupipe_consumers.chargeback.accounting import (
    BACKWARDS,
    CONTINUED,
    DUPLICATE,
    FIRST,
    MIG_SHARED,
    UNALLOCATED,
    AccountingConfig,
    ReferenceSample,
    account,
    activity_ratio,
    gpu_key,
    pod_shares,
)
from gpupipe_consumers.chargeback.errors import ChargebackConfigError
from tests.synthetic_fleet import blank_sample

CFG = AccountingConfig()  # default interval 10 s, max gap 2.5 x interval
T0 = 1_767_225_600_000


def sample(ts: int = T0, **kw):
    base = dict(
        timestamp_ms=ts,
        hostname="n1",
        gpu_index=0,
        uuid="GPU-a",
        pci_bus_id="0:1",
        model_name="NVIDIA H200",
        interval_ms=10_000,
        gpu_util_ratio=0.5,
        allocations=[alloc("team-a", "p1")],
    )
    base.update(kw)
    return blank_sample(**base)


def alloc(ns: str, pod: str, container: str = "main") -> dict:
    return {
        "namespace": ns,
        "pod": pod,
        "container": container,
        "resource_name": "nvidia.com/gpu",
        "replica": None,
    }


def proc(ns: str | None, pod: str | None, sm: float | None, pid: int = 1) -> dict:
    return {
        "pid": pid,
        "process_name": "python",
        "used_memory_bytes": None,
        "sm_util_ratio": sm,
        "mem_util_ratio": None,
        "namespace": ns,
        "pod": pod,
        "container": "main",
    }


def ref(ts: int, energy_mj: int | None = None, offset: int = 0) -> ReferenceSample:
    return ReferenceSample(ts, energy_mj, offset)


# -- timeline -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ref_ts", "ts", "status", "dt_ms", "moves_ref"),
    [
        (None, T0, FIRST, 10_000, True),  # first sample of a GPU: its nominal interval
        (T0, T0 + 10_000, CONTINUED, 10_000, True),
        (T0, T0 + 10_037, CONTINUED, 10_037, True),  # jitter is billed as measured
        (T0, T0 + 20_050, CONTINUED, 20_050, True),  # one lost sample: still billed
        (T0, T0 + 25_000, CONTINUED, 25_000, True),  # exactly the cap
        (T0, T0 + 25_001, FIRST, 25_000, True),  # a longer gap bills the cap, never less
        (T0, T0 + 3_600_000, FIRST, 25_000, True),
        (T0, T0, DUPLICATE, 0, False),  # same key, same timestamp: counted once
        (T0, T0 - 10_000, DUPLICATE, 0, False),  # re-sent / reordered within the cap
        (T0, T0 - 25_000, DUPLICATE, 0, False),
        (T0, T0 - 25_001, BACKWARDS, 10_000, False),  # clock jumped back: interval, never negative
        (T0, T0 - 3_600_000, BACKWARDS, 10_000, False),
    ],
)
def test_timeline(ref_ts, ts, status, dt_ms, moves_ref):
    r = None if ref_ts is None else ref(ref_ts, offset=41)
    res = account(sample(ts), r, 42, CFG)
    assert (res.status, res.dt_ms) == (status, dt_ms)
    assert (res.new_ref is not None) == moves_ref
    if moves_ref:
        assert res.new_ref.ts_ms == ts and res.new_ref.offset == 42
    assert res.dt_ms >= 0
    assert sum(c.allocated_s for c in res.contributions) == pytest.approx(dt_ms / 1000)
    # the decision depended on the reference unless the outcome is the same as without one
    assert res.depends_on == (None if ref_ts is None else 41)


@pytest.mark.parametrize(
    ("interval_ms", "expected_dt"),
    [(None, 10_000), (0, 10_000), (-5, 10_000), (1_000, 1_000), (86_400_000, 600_000)],
)
def test_nominal_interval_defaults_and_limit(interval_ms, expected_dt):
    res = account(sample(interval_ms=interval_ms), None, 0, CFG)
    assert res.dt_ms == expected_dt


def test_gpu_key_is_mig_uuid_for_slices():
    mig = {
        "mig_uuid": "MIG-1",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "1g.10gb",
        "slice_fraction": 1 / 7,
    }
    assert gpu_key(sample()) == "GPU-a"
    assert gpu_key(sample(mig=mig)) == "MIG-1"


# -- shares ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("allocations", "processes", "expected"),
    [
        ([], [], {(UNALLOCATED, None): 1.0}),
        ([alloc("a", "p1")], [], {("a", "p1"): 1.0}),
        # one pod with two containers on the GPU is one holder
        ([alloc("a", "p1", "c1"), alloc("a", "p1", "c2")], [], {("a", "p1"): 1.0}),
        # shared, no per-process data: by allocation (one device each)
        ([alloc("a", "p1"), alloc("b", "p2")], [], {("a", "p1"): 0.5, ("b", "p2"): 0.5}),
        (
            [alloc("a", "p1"), alloc("b", "p2"), alloc("b", "p3")],
            [],
            {("a", "p1"): 1 / 3, ("b", "p2"): 1 / 3, ("b", "p3"): 1 / 3},
        ),
        # measured SM use to its user, the idle rest by allocation; a pod's processes add up
        (
            [alloc("a", "p1"), alloc("b", "p2")],
            [proc("a", "p1", 0.3), proc("b", "p2", 0.1), proc("b", "p2", 0.2, pid=2)],
            {("a", "p1"): 0.3 + 0.2, ("b", "p2"): 0.3 + 0.2},
        ),
        (
            [alloc("a", "p1"), alloc("b", "p2")],
            [proc("a", "p1", 0.6), proc("b", "p2", 0.2)],
            {("a", "p1"): 0.6 + 0.1, ("b", "p2"): 0.2 + 0.1},
        ),
        # a holder with no process that ran still pays its allocation's part of the idle time
        ([alloc("a", "p1"), alloc("b", "p2")], [proc("a", "p1", 0.4)], {("a", "p1"): 0.7, ("b", "p2"): 0.3}),
        # a pod that does not hold the GPU pays its use; an unplaced process is the holders'
        # (SM over 1 is scaled to the whole GPU)
        (
            [alloc("a", "p1"), alloc("b", "p2")],
            [proc("c", "p9", 0.9), proc(None, None, 0.5)],
            {("a", "p1"): 0.25 / 1.4, ("b", "p2"): 0.25 / 1.4, ("c", "p9"): 0.9 / 1.4},
        ),
        # A (5% SM) and an unplaced process (90%, B's): never A 100%, never B 0, none unattributed
        (
            [alloc("a", "p1"), alloc("b", "p2")],
            [proc("a", "p1", 0.05), proc(None, None, 0.9)],
            {("a", "p1"): 0.05 + 0.45 + 0.025, ("b", "p2"): 0.45 + 0.025},
        ),
        (
            [alloc("a", "p1"), alloc("b", "p2")],
            [proc("a", "p1", 0.0), proc("b", "p2", None)],
            {("a", "p1"): 0.5, ("b", "p2"): 0.5},
        ),
    ],
)
def test_pod_shares(allocations, processes, expected):
    shares = pod_shares(sample(allocations=allocations, processes=processes))
    got = {(s.namespace, s.pod): s.weight for s in shares}
    assert got == pytest.approx(expected)
    assert sum(got.values()) == pytest.approx(1.0)


def test_shared_gpu_split_carries_time_energy_and_shared_flag():
    s = sample(
        allocations=[alloc("a", "p1"), alloc("b", "p2")],
        processes=[proc("a", "p1", 0.3), proc("b", "p2", 0.1)],
        power_w=400.0,
        gpu_util_ratio=0.8,
    )
    res = account(s, None, 0, CFG)
    by_ns = {c.namespace: c for c in res.contributions}
    # use 3 s and 1 s as measured, the 6 idle seconds by allocation
    assert by_ns["a"].allocated_s == pytest.approx(6.0)
    assert by_ns["b"].allocated_s == pytest.approx(4.0)
    assert by_ns["a"].used_s == pytest.approx(3.0)
    assert by_ns["a"].idle_s == pytest.approx(3.0)
    assert by_ns["a"].shared_s == by_ns["a"].allocated_s
    assert by_ns["a"].energy_j == pytest.approx(4000 * 0.6)
    assert by_ns["b"].energy_j == pytest.approx(4000 * 0.4)


def test_exclusive_gpu_is_not_shared():
    (c,) = account(sample(), None, 0, CFG).contributions
    assert c.shared_s == 0.0 and c.mig_s == 0.0 and c.lost_s == 0.0


# -- MIG ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fraction", "expected_s"), [(3 / 7, 10 * 3 / 7), (1 / 7, 10 / 7), (1.0, 10.0), (1.5, 10.0), (-0.1, 0.0)]
)
def test_mig_slice_counts_its_fraction(fraction, expected_s):
    mig = {
        "mig_uuid": "MIG-x",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
        "profile": "3g.40gb",
        "slice_fraction": fraction,
    }
    res = account(sample(mig=mig, mig_enabled=True, gpu_util_ratio=None, sm_active_ratio=0.5), None, 0, CFG)
    (c,) = res.contributions
    assert c.allocated_s == pytest.approx(expected_s)
    assert c.mig_s == pytest.approx(expected_s)
    assert c.used_s == pytest.approx(expected_s * 0.5)
    assert res.observed_gpu_s == pytest.approx(expected_s)


def test_mig_parent_accounts_no_time_but_its_energy_to_mig_shared():
    parent = sample(mig_enabled=True, allocations=[], power_w=300.0, gpu_util_ratio=None)
    res = account(parent, None, 0, CFG)
    (c,) = res.contributions
    assert res.observed_gpu_s == 0.0
    assert c.namespace == MIG_SHARED
    assert c.allocated_s == c.used_s == c.idle_s == c.unknown_s == 0.0
    assert c.energy_j == pytest.approx(3000.0)


def test_mig_parent_even_with_allocations_bills_no_time():
    res = account(sample(mig_enabled=True), None, 0, CFG)
    assert [c.namespace for c in res.contributions] == [MIG_SHARED]
    assert sum(c.allocated_s for c in res.contributions) == 0.0


# -- unallocated, lost, activity ------------------------------------------------------------------
def test_unallocated_gpu_time_goes_to_unallocated():
    (c,) = account(sample(allocations=[], gpu_util_ratio=0.0), None, 0, CFG).contributions
    assert (c.namespace, c.pod, c.allocated_s, c.idle_s) == (UNALLOCATED, None, 10.0, 10.0)


def test_lost_gpu_is_unallocated_and_flagged():
    s = sample(gpu_lost=True, gpu_util_ratio=None, allocations=[alloc("a", "p1")])
    (c,) = account(s, None, 0, CFG).contributions
    assert c.namespace == UNALLOCATED
    assert c.lost_s == c.allocated_s == c.unknown_s == 10.0
    assert c.used_s == c.idle_s == c.energy_j == 0.0


@pytest.mark.parametrize(
    ("sm", "util", "activity"),
    [
        (0.4, 0.9, 0.4),
        (None, 0.9, 0.9),
        (None, None, None),
        (1.2, None, 1.0),
        (-0.1, None, 0.0),
        (0.0, 0.7, 0.0),
    ],
)
def test_activity_prefers_sm_active(sm, util, activity):
    assert activity_ratio(sample(sm_active_ratio=sm, gpu_util_ratio=util)) == activity


@pytest.mark.parametrize(
    ("util", "used", "idle", "unknown"),
    [
        (0.0, 0.0, 10.0, 0.0),
        (0.04, 0.4, 10.0, 0.0),
        (0.05, 0.5, 0.0, 0.0),
        (0.6, 6.0, 0.0, 0.0),
        (None, 0.0, 0.0, 10.0),
    ],
)
def test_used_idle_unknown(util, used, idle, unknown):
    (c,) = account(sample(gpu_util_ratio=util), None, 0, CFG).contributions
    assert (c.used_s, c.idle_s, c.unknown_s) == pytest.approx((used, idle, unknown))


# -- energy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ref_energy", "energy", "power", "expected_j", "estimated_j"),
    [
        (1_000_000, 4_000_000, 250.0, 3000.0, 0.0),  # counter delta: 3e6 mJ = 3000 J in 10 s (300 W)
        (None, 4_000_000, 250.0, 2500.0, 2500.0),  # reference has no counter: power x time
        (1_000_000, None, 250.0, 2500.0, 2500.0),  # counter missing now
        (9_000_000, 1_000, 250.0, 2500.0, 2500.0),  # counter reset (driver reload)
        (1_000_000, 1_000_000 + 10**9, 250.0, 2500.0, 2500.0),  # 100 kW: implausible
        (1_000_000, 1_000_000, 250.0, 0.0, 0.0),  # no energy drawn (counter authoritative)
        (None, None, None, 0.0, 0.0),  # nothing known
    ],
)
def test_energy(ref_energy, energy, power, expected_j, estimated_j):
    res = account(sample(T0 + 10_000, total_energy_mj=energy, power_w=power), ref(T0, ref_energy), 1, CFG)
    (c,) = res.contributions
    assert c.energy_j == pytest.approx(expected_j)
    assert c.energy_estimated_j == pytest.approx(estimated_j)


def test_first_sample_energy_is_power_times_interval():
    (c,) = account(sample(total_energy_mj=123, power_w=100.0), None, 0, CFG).contributions
    assert c.energy_j == pytest.approx(1000.0)


def test_backwards_sample_energy_is_power_times_interval():
    res = account(sample(T0 - 60_000, total_energy_mj=5, power_w=100.0), ref(T0, 10**9), 1, CFG)
    assert res.status == BACKWARDS
    assert res.contributions[0].energy_j == pytest.approx(1000.0)


def test_clock_step_back_never_double_counts_energy():
    """The counter went on while the clock stepped back; the reference stays, so the next
    sample past it measures that energy: the backwards samples must not add power x interval."""
    res = account(sample(T0 - 60_000, total_energy_mj=2 * 10**9, power_w=100.0), ref(T0, 10**9), 1, CFG)
    assert res.status == BACKWARDS and res.contributions[0].energy_j == 0.0


def test_energy_series_through_a_step_back_and_a_gap_matches_the_counter():
    """End to end: 300 W for 30 min at 10 s with a 60 s clock step back and a 5-minute gap."""
    cfg, power, r, total_j, off = CFG, 300.0, None, 0.0, 0
    true_ts = list(range(T0, T0 + 1_800_000 + 1, 10_000))
    for t in true_ts:
        if T0 + 600_000 < t < T0 + 900_000:
            continue  # telemetry gap of 5 minutes (the counter keeps counting)
        clock = t - 60_000 if T0 + 1_200_000 <= t < T0 + 1_300_000 else t  # stepped back 60 s
        s = sample(clock, total_energy_mj=int((t - T0) * power), power_w=power)
        res = account(s, r, off, cfg)
        off += 1
        total_j += sum(c.energy_j for c in res.contributions)
        if res.new_ref is not None:
            r = res.new_ref
    true_j = 1_800_000 / 1000 * power
    assert total_j == pytest.approx(true_j + 10 * power)  # + the first sample's own interval


def test_a_longer_gap_never_bills_less():
    """The gap cap is monotonic: a 2.6 s gap never bills less than a 2.5 s one."""
    billed = [
        account(sample(T0 + gap, interval_ms=1_000), ref(T0), 1, CFG).dt_ms for gap in range(1, 30_000, 100)
    ]
    assert billed == sorted(billed) and billed[-1] == 2_500


def test_duplicate_contributes_nothing():
    res = account(sample(T0, power_w=100.0), ref(T0, 0), 1, CFG)
    assert res.contributions == () and res.observed_gpu_s == 0.0


def test_account_does_not_mutate_input():
    s = sample(allocations=[alloc("a", "p1"), alloc("b", "p2")])
    before = repr(s)
    account(s, ref(T0 - 10_000, 0), 1, CFG)
    assert repr(s) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"default_interval_ms": 0},
        {"max_gap_factor": 0.5},
        {"max_gap_limit_ms": 5},
        {"idle_activity_threshold": 2},
        {"max_plausible_power_w": 0},
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ChargebackConfigError):
        AccountingConfig(**kwargs)
