"""Per-sample GPU accounting: one ``GpuSample`` dict in, GPU-seconds and energy per namespace out.

Pure: no I/O, no clocks, no mutation of its inputs; the window engine keeps the one piece of state
per GPU (its :class:`ReferenceSample`) and adds the contributions up. The rules for time, energy,
shared GPUs and MIG: docs/inside-chargeback.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from gpupipe_consumers.chargeback.workloads import WorkloadKey, workload_keys
from gpupipe_schemas.meaning import MIG_SHARED, UNALLOCATED, UNATTRIBUTED, activity_ratio, gpu_key

# How a sample was placed on its GPU's timeline (see the module docstring).
FIRST = "first"
CONTINUED = "continued"
DUPLICATE = "duplicate"
BACKWARDS = "backwards"


def _unit(x: float) -> float:
    """``x`` clamped to [0, 1], NaN to 0 (``min``/``max`` would let NaN through into a bill)."""
    return min(x, 1.0) if x >= 0.0 else 0.0


class SharedAllocations(list):  # type: ignore[type-arg]
    """A sample's ``allocations`` that the decoder hands to every sample of a GPU whose identity
    bytes repeat (sample_decode.py): never mutated, so what is derived from it alone (holders,
    workload keys) is kept on it and derived once, not per sample."""

    __slots__ = ("holders", "workloads")

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.holders: dict[tuple[str, str], int] | None = None
        self.workloads: dict[tuple[str, str], WorkloadKey] | None = None


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
        from gpupipe_consumers.chargeback.errors import ChargebackConfigError

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


class ReferenceSample(NamedTuple):
    """The reference sample of one GPU key: what the next sample's time and energy are measured from.

    This and the other per-sample values below are named tuples: immutable like a frozen
    dataclass, built several times per sample at a fraction of its cost."""

    ts_ms: int
    energy_mj: int | None
    offset: int


class Contribution(NamedTuple):
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
    workload: WorkloadKey | None = None  # owner, labels, HPC job, claim of the pod (workloads.py)


class Accounted(NamedTuple):
    """The outcome of accounting one sample."""

    key: str
    status: str  # FIRST | CONTINUED | DUPLICATE | BACKWARDS
    dt_ms: int  # time the sample accounts for (0 for a duplicate)
    fraction: float  # share of a whole GPU the time is worth (0 for a MIG-mode whole GPU)
    contributions: tuple[Contribution, ...]
    new_ref: ReferenceSample | None  # the GPU's next reference, or None to keep the current one
    depends_on: int | None  # offset of the reference this outcome was decided against, if it mattered

    @property
    def observed_gpu_s(self) -> float:
        """GPU-seconds observed: accounted time x fraction (what the namespaces' shares add up to)."""
        return self.dt_ms / 1000.0 * self.fraction


#: ``_new(Cls, (fields...))`` builds a named tuple in C, without its generated Python ``__new__``:
#: used where account() builds them for every sample (the values in field order, as there).
_new = tuple.__new__


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


class Share(NamedTuple):
    """One party's part of a GPU's time in one sample, as fractions of that time."""

    namespace: str
    pod: str | None
    weight: float
    """Its part of the time (and the energy); the weights of a sample add up to 1."""
    used: float | None = None
    """On a shared GPU with per-process measurements, the measured-use part of ``weight`` (the
    rest is held-but-idle time); None where use is judged from the GPU's activity instead."""


def _holders(sample: dict[str, Any]) -> dict[tuple[str, str], int]:
    """(namespace, pod) -> allocation units: distinct replicas held, or 1 for a device without."""
    allocs = sample.get("allocations")
    if type(allocs) is SharedAllocations:
        if allocs.holders is None:
            allocs.holders = _count_holders(allocs)
        return allocs.holders
    return _count_holders(allocs)


def _count_holders(allocs: list[dict[str, Any]] | None) -> dict[tuple[str, str], int]:
    replicas: dict[tuple[str, str], set[int]] = {}
    for alloc in allocs or ():
        held = replicas.setdefault((alloc["namespace"], alloc["pod"]), set())
        if alloc.get("replica") is not None:
            held.add(int(alloc["replica"]))
    return {pair: max(len(held), 1) for pair, held in replicas.items()}


def _measured_use(
    sample: dict[str, Any], activity: float | None
) -> tuple[float, dict[tuple[str, str] | None, float]] | None:
    """(the GPU's used fraction, each process owner's weight in it); None where nothing measures it.

    SM first: the processes' ``sm_util_ratio`` (their sum is the used fraction, scaled down to the
    whole GPU when it exceeds 1). Memory second, only where no process reports SM use (NVML has no
    per-process samples on some GPUs and drivers): the GPU's activity split by ``used_memory_bytes``.
    The owner is the process's (namespace, pod), or None where the node could not place it.
    """
    sm = _owner_weights(sample, "sm_util_ratio")
    if sm:
        total = sum(sm.values())
        return min(total, 1.0), {owner: w / total for owner, w in sm.items()}
    memory = _owner_weights(sample, "used_memory_bytes")
    if memory and activity:
        total = sum(memory.values())
        return activity, {owner: w / total for owner, w in memory.items()}
    return None


def _owner_weights(sample: dict[str, Any], field: str) -> dict[tuple[str, str] | None, float]:
    """The positive ``field`` of the sample's processes summed per owner (SM ratios clamped to 1)."""
    out: dict[tuple[str, str] | None, float] = {}
    for proc in sample.get("processes") or ():
        value = proc.get(field)
        if value is None or not value > 0:
            continue
        ns, pod = proc.get("namespace"), proc.get("pod")
        owner = (ns, pod) if ns and pod else None
        out[owner] = out.get(owner, 0.0) + (_unit(float(value)) if field == "sm_util_ratio" else float(value))
    return out


def pod_shares(sample: dict[str, Any], activity: float | None = None) -> list[Share]:
    """Who pays for the sample's GPU time; the weights add up to 1 (see the module docstring).

    ``activity`` is the GPU's (``activity_ratio``): the memory-weighted use needs it.
    """
    if sample.get("gpu_lost"):
        return [Share(UNALLOCATED, None, 1.0)]
    if sample.get("allocations_known") is False:
        # The kubelet was unreachable, so "no allocation" means "unknown": tenants' time must not
        # silently become __unallocated__ capacity.
        return [Share(UNATTRIBUTED, None, 1.0)]
    units = _holders(sample)
    if not units:
        return [Share(UNALLOCATED, None, 1.0)]
    held = sum(units.values())
    replicas = sample.get("shared_replicas")
    capacity = max(int(replicas), held) if isinstance(replicas, int) and replicas > 0 else held
    if len(units) == 1 and capacity == held:
        # Exclusive: whatever runs on the GPU runs on the holder's allocation.
        ((ns, pod),) = units
        return [_new(Share, (ns, pod, 1.0, None))]  # the common case: built in C
    measured = _measured_use(sample, activity)
    if measured is None:
        # Nothing measures who used it: all of it by allocation.
        shares = [Share(ns, pod, n / capacity) for (ns, pod), n in units.items()]
        if capacity > held:
            shares.append(Share(UNALLOCATED, None, (capacity - held) / capacity))
        return shares
    used, owners = measured
    idle = 1.0 - used
    unplaced = used * owners.get(None, 0.0)  # only holders run on an allocated device: theirs
    shares = []
    for pair, n in units.items():
        use = used * owners.get(pair, 0.0) + unplaced * n / held
        shares.append(Share(pair[0], pair[1], use + idle * n / capacity, use))
    for owner, w in owners.items():
        if owner is not None and owner not in units:  # a pod using a GPU it does not hold
            shares.append(Share(owner[0], owner[1], used * w, used * w))
    if capacity > held:
        shares.append(Share(UNALLOCATED, None, idle * (capacity - held) / capacity, 0.0))
    return shares


def energy_counter(sample: dict[str, Any]) -> tuple[int | None, float]:
    """(the energy counter a sample's energy is measured on, the share of its delta that is the
    sample's): its own ``total_energy_mj``, else, on a MIG slice, the parent GPU's counter
    ``mig_parent_energy_mj`` times the slice fraction (NVML measures energy only on the GPU)."""
    own = sample.get("total_energy_mj")
    if own is not None:
        return int(own), 1.0
    parent = sample.get("mig_parent_energy_mj")
    if parent is not None and sample.get("mig"):
        return int(parent), gpu_fraction(sample)
    return None, 1.0


def _energy_j(
    sample: dict[str, Any],
    ref: ReferenceSample | None,
    status: str,
    dt_ms: int,
    cfg: AccountingConfig,
    counter: tuple[int | None, float],
) -> tuple[float, float]:
    """(energy in joules, the part of it estimated from power) for the accounted time;
    ``counter``: the sample's :func:`energy_counter`."""
    now, share = counter
    if ref is not None and ref.energy_mj is not None and now is not None:
        delta_mj = (now - ref.energy_mj) * share
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


def account(
    sample: dict[str, Any],
    ref: ReferenceSample | None,
    offset: int,
    cfg: AccountingConfig,
    key: str | None = None,
) -> Accounted:
    """Account one sample against its GPU's reference (None: no usable reference); ``key``: its
    :func:`gpu_key` when the caller has it already."""
    # nominal_interval_ms, max_gap_ms, gpu_fraction and energy_counter, inline (the same
    # expressions): this runs for every sample, and the calls cost more than their work
    get = sample.get
    mig = get("mig")
    if key is None:
        key = gpu_key(sample)
    ts = int(sample["timestamp_ms"])
    interval = get("interval_ms")
    if not interval or interval <= 0:
        interval = cfg.default_interval_ms
    interval = min(int(interval), cfg.max_gap_limit_ms)
    cap = min(int(interval * cfg.max_gap_factor), cfg.max_gap_limit_ms)
    own = get("total_energy_mj")
    counter = (int(own), 1.0) if own is not None else energy_counter(sample)
    this_ref = _new(ReferenceSample, (ts, counter[0], offset))

    depends_on: int | None = None
    new_ref: ReferenceSample | None = this_ref
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

    fraction = _unit(float(mig.get("slice_fraction") or 0.0)) if mig else 0.0 if get("mig_enabled") else 1.0
    if status == DUPLICATE:
        return Accounted(key, status, 0, fraction, (), new_ref, depends_on)

    energy_j, estimated_j = _energy_j(sample, ref, status, dt_ms, cfg, counter)
    node = sample["hostname"]
    model = sample["model_name"]

    if fraction == 0.0 and get("mig_enabled") and not mig:
        return _mig_parent(sample, key, status, dt_ms, energy_j, estimated_j, new_ref, depends_on)

    gpu_s = dt_ms / 1000.0 * fraction
    activity = activity_ratio(sample)
    lost = bool(get("gpu_lost"))
    is_mig = bool(mig)
    shares = pod_shares(sample, activity)
    shared = len(shares) > 1
    allocs = get("allocations")
    if type(allocs) is SharedAllocations:
        if allocs.workloads is None:
            allocs.workloads = workload_keys(sample)
        workload = allocs.workloads
    else:
        workload = workload_keys(sample)
    out = []
    for share in shares:
        namespace, pod, weight = share.namespace, share.pod, share.weight
        alloc_s = gpu_s * weight
        if share.used is not None:  # measured per process: its use, and the held-but-idle rest
            used_s, idle_s, unknown_s = gpu_s * share.used, gpu_s * (weight - share.used), 0.0
        elif activity is None:
            used_s, idle_s, unknown_s = 0.0, 0.0, alloc_s
        else:
            used_s = alloc_s * activity
            idle_s = alloc_s if activity < cfg.idle_activity_threshold else 0.0
            unknown_s = 0.0
        out.append(
            _new(
                Contribution,
                (  # in Contribution's field order
                    namespace,
                    pod,
                    node,
                    model,
                    alloc_s,
                    used_s,
                    idle_s,
                    unknown_s,
                    alloc_s if shared else 0.0,  # shared_s
                    alloc_s if is_mig else 0.0,  # mig_s
                    alloc_s if lost else 0.0,  # lost_s
                    energy_j * weight,
                    estimated_j * weight,
                    workload.get((namespace, pod)) if pod is not None else None,
                ),
            )
        )
    return _new(Accounted, (key, status, dt_ms, fraction, tuple(out), new_ref, depends_on))


def _mig_parent(
    sample: dict[str, Any],
    key: str,
    status: str,
    dt_ms: int,
    energy_j: float,
    estimated_j: float,
    new_ref: ReferenceSample | None,
    depends_on: int | None,
) -> Accounted:
    """The whole-GPU record of a GPU in MIG mode: no time of its own (its slices bill it), the
    capacity no slice covers to ``__unallocated__``, and the energy the slices do not bill."""
    node, model = sample["hostname"], sample["model_name"]
    configured = sample.get("mig_configured_fraction")
    by_slice = bool(sample.get("mig_energy_by_slice"))
    uncovered = 0.0 if configured is None else _unit(1.0 - float(configured))
    contribs: list[Contribution] = []
    if not by_slice:
        # Slices without the parent's counter cannot bill energy: it stays whole, on the node.
        zero = (0.0,) * 7
        contribs.append(Contribution(MIG_SHARED, None, node, model, *zero, energy_j, estimated_j))
    # Capacity no slice covers is capacity nobody can use: __unallocated__, so the namespaces plus
    # __unallocated__ reconcile with physical GPU-hours (and, by slice, with the GPU's energy).
    free_s = dt_ms / 1000.0 * uncovered
    if free_s > 0:
        free_j, free_est = (energy_j * uncovered, estimated_j * uncovered) if by_slice else (0.0, 0.0)
        times = (free_s, 0.0, 0.0, free_s, 0.0, free_s, 0.0)  # allocated, unknown and MIG time
        contribs.append(Contribution(UNALLOCATED, None, node, model, *times, free_j, free_est))
    return Accounted(key, status, dt_ms, uncovered, tuple(contribs), new_ref, depends_on)
