"""Per-sample GPU accounting: one ``GpuSample`` dict in, GPU-seconds and energy per namespace out.

Pure: no I/O, no clocks, no mutation of its inputs. The window engine (``windows.py``) keeps the
one piece of state per GPU that the rules below need (the GPU's *reference sample*) and adds the
contributions up.

Time
----
A sample accounts for the time since its GPU's reference sample. The GPU key is the MIG device
UUID for a MIG slice and the GPU UUID otherwise; the reference is the sample of that key with the
highest timestamp seen so far (a running maximum: see ``windows.py`` for why that makes recovery by
replay exact). With ``interval`` the sample's ``interval_ms`` (``default_interval_ms`` when null)
and ``cap = min(max_gap_factor x interval, max_gap_limit_ms)``:

========================  ====================================  ===========  ==================
case                      condition (gap = ts - ref.ts)          accounted    reference becomes
========================  ====================================  ===========  ==================
first                     no (usable) reference                  interval     this sample
after a long gap          gap > cap                              cap          this sample
continued                 0 < gap <= cap                         gap          this sample
duplicate / reordered     -cap <= gap <= 0                       nothing      unchanged
clock went backwards      gap < -cap                             interval     unchanged
========================  ====================================  ===========  ==================

So N samples of a steadily sampled GPU account N intervals (the first one its nominal interval),
a gap longer than ``cap`` is billed ``cap`` (so a longer gap never bills less than a shorter
one; the rest of it is not billed as use), a repeated sample
(same key, same timestamp) counts once, and a clock that jumps back never yields negative time:
its samples count their nominal interval until the clock passes the old maximum again (the last
``cap`` before that are taken for duplicates and skipped, a bounded loss of about two samples).
A duplicate of a sample older than ``cap`` behind the maximum cannot be told from a clock jump and
is counted; with an idempotent producer that does not happen.

Fractions and shares
--------------------
* A whole GPU counts 1; a MIG slice counts ``mig.slice_fraction`` (clamped to 0..1).
* The whole-GPU record of a GPU in MIG mode (``mig_enabled`` true, ``mig`` null) accounts no
  time (its slices do). NVML measures power and energy only on that whole GPU, and the slices are
  keyed (hence partitioned) apart from it, so its energy goes to the pseudo-namespace
  ``__mig_shared__`` of its node: complete totals, honestly not split per slice. Slice records
  with energy fields of their own are used as they are (a producer must not copy the parent's
  power into its slices, or it is counted twice).
* GPU time no pod holds goes to ``__unallocated__``. A sample with ``gpu_lost`` also goes there
  (flagged in ``lost_s``): no tenant can use a GPU that fell off the bus, so none pays for it.
* A GPU (or slice, or time-sliced GPU) held by several distinct (namespace, pod) pairs is split by
  the pods' summed per-process ``sm_util_ratio`` when processes carry pod attribution and the sum
  is positive (pods with no process get nothing for that sample), else equally. The SM share of
  processes no holder owns (unattributed, or of a pod that does not hold the GPU) goes to
  ``__unattributed__``, never to the other holders.

Activity, idle, energy
----------------------
* Activity is ``sm_active_ratio`` where reported, else ``gpu_util_ratio`` (clamped to 0..1);
  ``used = allocated x activity``. With neither, the time counts as ``unknown``.
* ``idle`` is allocated time of samples whose activity is below ``idle_activity_threshold``:
  held but inactive (what a chargeback reader looks for), rather than ``allocated - used``.
* Energy is the ``total_energy_mj`` delta against the reference sample for a *continued* sample
  and for one after a long gap (the whole gap's energy: the counter survives telemetry gaps); a
  sample of a clock that stepped back, with the counter still going up, adds none (the next sample
  past the reference measures it). Otherwise, or when a counter is missing, went backwards (driver
  reload) or implies more than
  ``max_plausible_power_w``, it is ``power_w x accounted time`` (counted as estimated). With
  neither it is 0. It is split like the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from consumers.chargeback.workloads import WorkloadKey, workload_keys
from schemas.meaning import MIG_SHARED, UNALLOCATED, UNATTRIBUTED, activity_ratio, gpu_key

# How a sample was placed on its GPU's timeline (see the module docstring).
FIRST = "first"
CONTINUED = "continued"
DUPLICATE = "duplicate"
BACKWARDS = "backwards"


def _unit(x: float) -> float:
    """``x`` clamped to [0, 1], NaN to 0 (``min``/``max`` would let NaN through into a bill)."""
    return min(x, 1.0) if x >= 0.0 else 0.0


@dataclass(frozen=True, slots=True)
class AccountingConfig:
    """Knobs of the accounting rules; the defaults suit 1..10 s sampling."""

    default_interval_ms: int = 10_000
    """Nominal interval of samples whose ``interval_ms`` is null or not positive."""
    max_gap_factor: float = 2.5
    """A gap up to this many intervals is billed as it is (one lost sample plus jitter); a longer one
    only the sample's own interval."""
    max_gap_limit_ms: int = 600_000
    """Upper bound of any cap (and of a nominal interval): also the GPU state's staleness margin."""
    idle_activity_threshold: float = 0.05
    """Activity below this counts the allocated time as idle."""
    max_plausible_power_w: float = 3_000.0
    """An energy-counter delta implying more average power than this is a glitch: use power_w."""

    def __post_init__(self) -> None:
        from consumers.chargeback.errors import ChargebackConfigError

        if self.default_interval_ms <= 0:
            raise ChargebackConfigError(f"default_interval_ms must be > 0, got {self.default_interval_ms}")
        if self.max_gap_factor < 1:
            raise ChargebackConfigError(f"max_gap_factor must be >= 1, got {self.max_gap_factor}")
        if self.max_gap_limit_ms < self.default_interval_ms:
            raise ChargebackConfigError("max_gap_limit_ms must be >= default_interval_ms")
        if not 0 <= self.idle_activity_threshold <= 1:
            raise ChargebackConfigError("idle_activity_threshold must be within 0..1")
        if self.max_plausible_power_w <= 0:
            raise ChargebackConfigError("max_plausible_power_w must be > 0")


@dataclass(frozen=True, slots=True)
class GpuRef:
    """The reference sample of one GPU key: what the next sample's time and energy are measured from."""

    ts_ms: int
    energy_mj: int | None
    offset: int


@dataclass(frozen=True, slots=True)
class Contribution:
    """What one sample adds to one (namespace, pod) on its node and GPU model. Seconds are GPU-seconds."""

    namespace: str
    pod: str | None
    node: str
    gpu_model: str
    allocated_s: float
    used_s: float
    idle_s: float
    unknown_s: float
    shared_s: float
    mig_s: float
    lost_s: float
    energy_j: float
    energy_estimated_j: float
    workload: WorkloadKey | None = None  # owner, labels, HPC job of the pod (workloads.py)


@dataclass(frozen=True, slots=True)
class Accounted:
    """The outcome of accounting one sample."""

    key: str
    status: str  # FIRST | CONTINUED | DUPLICATE | BACKWARDS
    dt_ms: int  # time the sample accounts for (0 for a duplicate)
    fraction: float  # share of a whole GPU the time is worth (0 for a MIG-mode whole GPU)
    contributions: tuple[Contribution, ...]
    new_ref: GpuRef | None  # the GPU's next reference, or None to keep the current one
    depends_on: int | None  # offset of the reference this outcome was decided against, if it mattered

    @property
    def observed_gpu_s(self) -> float:
        """GPU-seconds observed: accounted time x fraction (what the namespaces' shares add up to)."""
        return self.dt_ms / 1000.0 * self.fraction


def nominal_interval_ms(sample: dict[str, Any], cfg: AccountingConfig) -> int:
    interval = sample.get("interval_ms")
    if not interval or interval <= 0:
        interval = cfg.default_interval_ms
    return min(int(interval), cfg.max_gap_limit_ms)


def max_gap_ms(interval_ms: int, cfg: AccountingConfig) -> int:
    return min(int(interval_ms * cfg.max_gap_factor), cfg.max_gap_limit_ms)


def gpu_fraction(sample: dict[str, Any]) -> float:
    """Share of a whole GPU the sample's time is worth: 1, a MIG slice's fraction, or 0 for a MIG-mode GPU."""
    mig = sample.get("mig")
    if mig:
        return _unit(float(mig.get("slice_fraction") or 0.0))
    if sample.get("mig_enabled"):
        return 0.0
    return 1.0


def pod_shares(sample: dict[str, Any]) -> list[tuple[str, str | None, float]]:
    """(namespace, pod, weight) of the holders of the sample's GPU; weights add up to 1."""
    if sample.get("gpu_lost"):
        return [(UNALLOCATED, None, 1.0)]
    if sample.get("allocations_known") is False:
        # Review L1: the kubelet was unreachable, so "no allocation" means "unknown": tenants' time
        # must not silently become __unallocated__ capacity.
        return [(UNATTRIBUTED, None, 1.0)]
    pods: list[tuple[str, str]] = []
    for alloc in sample.get("allocations") or ():
        pair = (alloc["namespace"], alloc["pod"])
        if pair not in pods:
            pods.append(pair)
    if not pods:
        return [(UNALLOCATED, None, 1.0)]
    if len(pods) == 1:
        return [(pods[0][0], pods[0][1], 1.0)]
    use = dict.fromkeys(pods, 0.0)
    for proc in sample.get("processes") or ():
        pair = (proc.get("namespace"), proc.get("pod"))
        util = proc.get("sm_util_ratio")
        if pair in use and util is not None and util > 0:
            use[pair] += float(util)
    unattributed = 0.0  # SM of processes no holder owns (attribution failed, or a stale pod)
    for proc in sample.get("processes") or ():
        pair = (proc.get("namespace"), proc.get("pod"))
        util = proc.get("sm_util_ratio")
        if pair not in use and util is not None and util > 0:
            unattributed += float(util)
    total = sum(use.values()) + unattributed
    if total > 0:
        # Review D8: the unattributed share is nobody's to pay; never give it to the other holders.
        shares = [(ns, pod, use[(ns, pod)] / total) for ns, pod in pods]
        if unattributed > 0:
            shares.append((UNATTRIBUTED, None, unattributed / total))
        return shares
    return [(ns, pod, 1.0 / len(pods)) for ns, pod in pods]


def _energy_j(
    sample: dict[str, Any], ref: GpuRef | None, status: str, dt_ms: int, cfg: AccountingConfig
) -> tuple[float, float]:
    """(energy in joules, the part of it estimated from power) for the accounted time."""
    now = sample.get("total_energy_mj")
    if ref is not None and ref.energy_mj is not None and now is not None:
        delta_mj = now - ref.energy_mj
        if status == CONTINUED or (status == FIRST and sample["timestamp_ms"] > ref.ts_ms):
            # After a gap too: the counter is the one measurement that survives
            # telemetry gaps, so its delta over the whole gap is kept when it is continuous.
            span_ms = max(dt_ms, int(sample["timestamp_ms"]) - ref.ts_ms)
            if delta_mj >= 0 and delta_mj <= cfg.max_plausible_power_w * span_ms:  # W x ms == mJ
                return delta_mj / 1000.0, 0.0
        elif status == BACKWARDS and delta_mj >= 0:
            # The clock stepped back but the counter went on: the reference stays, so the next
            # sample past it measures this energy in its delta. Counting it here too doubled it.
            return 0.0, 0.0
    power = sample.get("power_w")
    if power is None or power < 0:
        return 0.0, 0.0
    joules = float(power) * dt_ms / 1000.0
    return joules, joules


def account(sample: dict[str, Any], ref: GpuRef | None, offset: int, cfg: AccountingConfig) -> Accounted:
    """Account one sample against its GPU's reference (None: no usable reference)."""
    key = gpu_key(sample)
    ts = int(sample["timestamp_ms"])
    interval = nominal_interval_ms(sample, cfg)
    cap = max_gap_ms(interval, cfg)
    this_ref = GpuRef(ts, sample.get("total_energy_mj"), offset)

    depends_on: int | None = None
    new_ref: GpuRef | None = this_ref
    if ref is None:
        status, dt_ms = FIRST, interval
    elif ts - ref.ts_ms > cap:
        # A gap longer than the cap bills the cap, never less than a shorter gap would: a 2.6 s
        # gap must not bill less than a 2.5 s one. Depends on the reference.
        status, dt_ms, depends_on = FIRST, max(interval, cap), ref.offset
    else:
        depends_on = ref.offset
        gap = ts - ref.ts_ms
        if gap > 0:
            status, dt_ms = CONTINUED, gap
        elif gap >= -cap:
            status, dt_ms, new_ref = DUPLICATE, 0, None
        else:
            status, dt_ms, new_ref = BACKWARDS, interval, None

    fraction = gpu_fraction(sample)
    if status == DUPLICATE:
        return Accounted(key, status, 0, fraction, (), new_ref, depends_on)

    energy_j, estimated_j = _energy_j(sample, ref, status, dt_ms, cfg)
    node = sample["hostname"]
    model = sample["model_name"]

    if fraction == 0.0 and sample.get("mig_enabled") and not sample.get("mig"):
        contrib = Contribution(
            MIG_SHARED, None, node, model, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, energy_j, estimated_j
        )
        configured = sample.get("mig_configured_fraction")
        if configured is None:
            return Accounted(key, status, dt_ms, 0.0, (contrib,), new_ref, depends_on)
        # Review L5: capacity no slice covers is capacity nobody can use: __unallocated__, so the
        # namespaces plus __unallocated__ reconcile with physical GPU-hours.
        uncovered = _unit(1.0 - float(configured))
        free_s = dt_ms / 1000.0 * uncovered
        free = Contribution(
            UNALLOCATED, None, node, model, free_s, 0.0, 0.0, free_s, 0.0, free_s, 0.0, 0.0, 0.0
        )
        contribs = (contrib, free) if free_s > 0 else (contrib,)
        return Accounted(key, status, dt_ms, uncovered, contribs, new_ref, depends_on)

    gpu_s = dt_ms / 1000.0 * fraction
    activity = activity_ratio(sample)
    lost = bool(sample.get("gpu_lost"))
    is_mig = bool(sample.get("mig"))
    shares = pod_shares(sample)
    shared = len(shares) > 1
    workload = workload_keys(sample)
    out = []
    for namespace, pod, weight in shares:
        alloc_s = gpu_s * weight
        out.append(
            Contribution(
                namespace=namespace,
                pod=pod,
                node=node,
                gpu_model=model,
                allocated_s=alloc_s,
                used_s=alloc_s * activity if activity is not None else 0.0,
                idle_s=alloc_s if activity is not None and activity < cfg.idle_activity_threshold else 0.0,
                unknown_s=alloc_s if activity is None else 0.0,
                shared_s=alloc_s if shared else 0.0,
                mig_s=alloc_s if is_mig else 0.0,
                lost_s=alloc_s if lost else 0.0,
                energy_j=energy_j * weight,
                energy_estimated_j=estimated_j * weight,
                workload=workload.get((namespace, pod)) if pod is not None else None,
            )
        )
    return Accounted(key, status, dt_ms, fraction, tuple(out), new_ref, depends_on)
