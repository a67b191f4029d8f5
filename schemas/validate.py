"""What a record's fields may hold, beyond what Avro checks: one place every consumer asks.

Avro says a ``timestamp_ms`` is a long and ``power_w`` a double; it lets through a sample dated
-2**63, a NaN power or a 200 KB namespace, each of which any GPU node may write and each of which
once stopped or poisoned a consumer (a window start beyond Avro's range, NaN bills, an 11 MB scrape).
:func:`violation` names the first field out of bounds and the bound, or None; the consumers
dead-letter such a record with that text and count it.

Bounds are deliberately wide: they refuse the impossible, never the unusual. Kubernetes' own name
limits bound the identity strings (a DNS label is 63 characters, a subdomain 253).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gpupipe_schemas import records

__all__ = [
    "MAX_AGE_MS",
    "MAX_AHEAD_MS",
    "MAX_LABELS",
    "fields_check",
    "fields_violation",
    "reading_max",
    "reading_range",
    "violation",
]

DAY_MS = 86_400_000
#: An event may be dated this far after the broker's clock (or ours): wide, because replays and test
#: fleets run on dates of their own; what it refuses is the year 2100 or 292 million.
MAX_AHEAD_MS = 366 * DAY_MS
#: ... and this far before it: the chargeback topic's 400 days of retention, replayed.
MAX_AGE_MS = 400 * DAY_MS

#: The readings each bound applies to: the schema marks them (``gpupipe.bound``).
_RATIOS = records.GPU_SAMPLE_BOUND_RATIO  # of a whole (utilisation, activity, a MIG slice's share)
_POWERS = records.GPU_SAMPLE_BOUND_POWER
_TEMPERATURES = records.GPU_SAMPLE_BOUND_TEMPERATURE
_OTHER_DOUBLES = records.GPU_SAMPLE_BOUND_FINITE
_NON_NEGATIVE_LONGS = records.GPU_SAMPLE_BOUND_NON_NEGATIVE
_PROCESS_RATIOS = records.GPU_PROCESS_BOUND_RATIO
#: No GPU module draws 10 kW; readings above 3x the GPU's own power limit are no reading either.
POWER_MAX_W = 10_000.0
POWER_OVER_LIMIT = 3.0
TEMPERATURE_C = (-60.0, 250.0)
#: Any other double: finite and within this magnitude (NVLink bytes/s reach 1e12).
MAGNITUDE_MAX = 1e15
#: Xid and NVSwitch SXid codes (five digits) are small non-negative numbers; 0 is a driver's
#: "unknown", and codes the catalogue does not know yet still alert.
XID_RANGE = (0, 65_535)
#: Replicas of one time-sliced device: the device plugin's own limit is far below this; a count
#: outside it is no count (and would make every tenant's share of the idle time vanish).
REPLICAS_RANGE = (1, 1_024)

#: Kubernetes' limits: a namespace and a container are DNS labels, a pod and a node DNS subdomains.
_NAME_LIMITS = {
    "hostname": 253,
    "uuid": 128,
    "pci_bus_id": 32,
    "model_name": 256,
    "driver_version": 64,
}
_ALLOCATION_LIMITS = {
    "namespace": 63,
    "pod": 253,
    "container": 63,
    "resource_name": 317,
    "owner_kind": 63,
    "owner_name": 253,
    "priority_class": 253,
    "hpc_job": 253,
    "claim_name": 253,
    "claim_namespace": 63,
    "dra_pool": 253,
    "dra_device": 253,
    "dra_share_id": 253,
}
#: Label keys may be prefixed (253 + "/" + 63); values are at most 63.
LABEL_KEY_MAX, LABEL_VALUE_MAX = 317, 63
#: Labels per allocation: the producer copies only the keys --pod-labels selects (three by default)
#: and refuses more than this many; past it, thousands of tiny labels in one record would cost every
#: reader per label (workload keys, one OTLP attribute each).
MAX_LABELS = 64
#: Any other string (an XID's kernel message, a process name).
STRING_MAX = 4096
MAX_ALLOCATIONS, MAX_PROCESSES = 256, 4096


def reading_range(name: str) -> tuple[float, float] | None:
    """``(lo, hi)``: what a GpuSample reading ``name`` may hold on its own, NaN never (None: not
    bounded alone; the power's bound against its limit takes two fields).

    For a reader that checks readings without decoding whole records (the metrics split decoder
    matches their bytes): what it lets through, :func:`violation` would."""
    if name in _RATIOS:
        return 0.0, 1.0
    if name in _POWERS:
        return 0.0, POWER_MAX_W
    if name in _TEMPERATURES:
        return TEMPERATURE_C
    if name in _OTHER_DOUBLES:
        return -MAGNITUDE_MAX, MAGNITUDE_MAX
    if name in _NON_NEGATIVE_LONGS:
        return 0.0, math.inf
    return None


def reading_max(name: str) -> float | None:
    """The largest value a GpuSample double reading ``name`` may hold (None: not bounded here).

    For a reader that shows readings without checking whole records (the metrics exposition
    converts them only when scraped): what :func:`violation` refuses, it does not print."""
    bounds = reading_range(name)
    return None if bounds is None or bounds[1] == math.inf else bounds[1]


def _long_strings(rec: Mapping[str, Any], limits: Mapping[str, int], where: str) -> str | None:
    for name, limit in limits.items():
        v = rec.get(name)
        if isinstance(v, str) and len(v) > limit:
            return f"{where}{name}: {len(v)} characters, at most {limit}"
    return None


def _allocations(rec: Mapping[str, Any]) -> str | None:
    allocs = rec.get("allocations")
    if not isinstance(allocs, list):
        return None
    if len(allocs) > MAX_ALLOCATIONS:
        return f"allocations: {len(allocs)} entries, at most {MAX_ALLOCATIONS}"
    for i, a in enumerate(allocs):
        if not isinstance(a, Mapping):
            continue
        bad = _long_strings(a, _ALLOCATION_LIMITS, f"allocations[{i}].")
        if bad:
            return bad
        labels = a.get("labels") or {}
        if len(labels) > MAX_LABELS:
            return f"allocations[{i}].labels: {len(labels)} entries, at most {MAX_LABELS}"
        for k, v in labels.items():
            if len(k) > LABEL_KEY_MAX or (isinstance(v, str) and len(v) > LABEL_VALUE_MAX):
                return f"allocations[{i}].labels: a label over {LABEL_KEY_MAX}/{LABEL_VALUE_MAX} characters"
    return None


def _time(rec: Mapping[str, Any], broker_ms: int | None, now_ms: int) -> str | None:
    ts = rec.get("timestamp_ms")
    if not isinstance(ts, int):
        return None
    refs = [now_ms] if broker_ms is None or broker_ms <= 0 else [now_ms, broker_ms]
    if ts > max(refs) + MAX_AHEAD_MS:
        return f"timestamp_ms: {ts}, more than {MAX_AHEAD_MS // DAY_MS} days ahead of the broker's clock"
    if ts < min(refs) - MAX_AGE_MS:
        return f"timestamp_ms: {ts}, more than {MAX_AGE_MS // DAY_MS} days before the broker's clock"
    return None


def _ratios(rec: Mapping[str, Any]) -> str | None:
    for name in _RATIOS:
        v = rec.get(name)
        if isinstance(v, float) and not 0.0 <= v <= 1.0:
            return f"{name}: {v!r}, a ratio within [0, 1]"
    return None


def _mig(rec: Mapping[str, Any]) -> str | None:
    mig = rec.get("mig")
    if isinstance(mig, Mapping):
        f = mig.get("slice_fraction")
        if isinstance(f, float) and not 0.0 <= f <= 1.0:
            return f"mig.slice_fraction: {f!r}, a ratio within [0, 1]"
    return None


def _powers(rec: Mapping[str, Any]) -> str | None:
    limit = rec.get("power_limit_w")
    for name in _POWERS:
        v = rec.get(name)
        if isinstance(v, float):
            if not 0.0 <= v <= POWER_MAX_W:
                return f"{name}: {v!r}, within [0, {POWER_MAX_W:g}] W"
            if isinstance(limit, float) and limit > 0 and v > POWER_OVER_LIMIT * limit:
                return f"{name}: {v!r}, over {POWER_OVER_LIMIT:g}x the power limit {limit:g} W"
    return None


def _temperatures(rec: Mapping[str, Any]) -> str | None:
    lo, hi = TEMPERATURE_C
    for name in _TEMPERATURES:
        v = rec.get(name)
        if isinstance(v, float) and not lo <= v <= hi:
            return f"{name}: {v!r}, within [{lo:g}, {hi:g}] C"
    return None


def _other_doubles(rec: Mapping[str, Any]) -> str | None:
    for name in _OTHER_DOUBLES:
        v = rec.get(name)
        if isinstance(v, float) and not -MAGNITUDE_MAX <= v <= MAGNITUDE_MAX:  # NaN fails too
            return f"{name}: {v!r}, finite and within {MAGNITUDE_MAX:g}"
    return None


def _longs(rec: Mapping[str, Any]) -> str | None:
    for name in _NON_NEGATIVE_LONGS:
        v = rec.get(name)
        if isinstance(v, int) and v < 0:
            return f"{name}: {v}, not negative"
    return None


def _replicas(rec: Mapping[str, Any]) -> str | None:
    replicas = rec.get("shared_replicas")
    if isinstance(replicas, int) and not REPLICAS_RANGE[0] <= replicas <= REPLICAS_RANGE[1]:
        return f"shared_replicas: {replicas}, within [{REPLICAS_RANGE[0]}, {REPLICAS_RANGE[1]}]"
    return None


def _last_xid(rec: Mapping[str, Any]) -> str | None:
    last = rec.get("last_xid")
    if isinstance(last, int) and not XID_RANGE[0] <= last <= XID_RANGE[1]:
        return f"last_xid: {last}, an Xid code within [{XID_RANGE[0]}, {XID_RANGE[1]}]"
    return None


def _processes(rec: Mapping[str, Any]) -> str | None:
    procs = rec.get("processes")
    if isinstance(procs, list):
        if len(procs) > MAX_PROCESSES:
            return f"processes: {len(procs)} entries, at most {MAX_PROCESSES}"
        for i, p in enumerate(procs):
            if not isinstance(p, Mapping):
                continue
            for name in _PROCESS_RATIOS:
                v = p.get(name)
                if isinstance(v, float) and not 0.0 <= v <= 1.0:
                    return f"processes[{i}].{name}: {v!r}, a ratio within [0, 1]"
            bad = _long_strings(p, {**_ALLOCATION_LIMITS, "process_name": STRING_MAX}, f"processes[{i}].")
            if bad:
                return bad
    return None


#: A GpuSample's checks in order, each with the fields that can make it fail.
_SAMPLE_CHECKS = (
    (frozenset(_RATIOS), _ratios),
    (frozenset({"mig"}), _mig),
    (frozenset(_POWERS), _powers),
    (frozenset(_TEMPERATURES), _temperatures),
    (frozenset(_OTHER_DOUBLES), _other_doubles),
    (frozenset(_NON_NEGATIVE_LONGS), _longs),
    (frozenset({"shared_replicas"}), _replicas),
    (frozenset({"last_xid"}), _last_xid),
    (frozenset({"processes"}), _processes),
)


def _sample(rec: Mapping[str, Any]) -> str | None:
    for _, check in _SAMPLE_CHECKS:
        bad = check(rec)
        if bad:
            return bad
    return None


def _xid(rec: Mapping[str, Any]) -> str | None:
    code = rec.get("xid")
    if isinstance(code, int) and not XID_RANGE[0] <= code <= XID_RANGE[1]:
        return f"xid: {code}, an Xid code within [{XID_RANGE[0]}, {XID_RANGE[1]}]"
    return _long_strings(rec, {"message": STRING_MAX, "process_name": STRING_MAX, "boot_id": 64}, "")


#: A bill may be re-emitted long after its window (a reprocessing run): windows are bounded below by
#: a date, not by their distance from the broker's clock.
WINDOW_EPOCH_MS = 946_684_800_000  # 2000-01-01T00:00:00Z


def _window(rec: Mapping[str, Any], broker_ms: int | None, now_ms: int) -> str | None:
    ahead = max(now_ms, broker_ms or 0) + MAX_AHEAD_MS
    for name in ("window_start_ms", "window_end_ms"):
        v = rec.get(name)
        if isinstance(v, int) and not WINDOW_EPOCH_MS <= v <= ahead:
            return (
                f"{name}: {v}, from 2000-01-01 to {MAX_AHEAD_MS // DAY_MS} days ahead of the broker's clock"
            )
    for name, v in rec.items():
        if isinstance(v, float) and not -MAGNITUDE_MAX <= v <= MAGNITUDE_MAX:  # NaN fails too
            return f"{name}: {v!r}, finite and within {MAGNITUDE_MAX:g}"
    for i, w in enumerate(rec.get("workloads") or ()):
        for name, v in w.items() if isinstance(w, Mapping) else ():
            if isinstance(v, float) and not -MAGNITUDE_MAX <= v <= MAGNITUDE_MAX:
                return f"workloads[{i}].{name}: {v!r}, finite and within {MAGNITUDE_MAX:g}"
    return None


def violation(name: str, rec: Mapping[str, Any], broker_ms: int | None, now_ms: int) -> str | None:
    """The first field of ``rec`` (a ``name`` record) out of bounds, with the bound; None if none.

    ``broker_ms`` is the record's Kafka timestamp, ``now_ms`` the consumer's clock: an event time far
    from both is refused (one of them may be off, not both by a day)."""
    if name == "ChargebackWindow":
        return _window(rec, broker_ms, now_ms)
    if name not in ("GpuSample", "XidEvent"):
        return None
    bad = _time(rec, broker_ms, now_ms) or _long_strings(rec, _NAME_LIMITS, "") or _allocations(rec)
    if bad:
        return bad
    return _sample(rec) if name == "GpuSample" else _xid(rec)


#: A check of a record given the broker's and the consumer's clocks: the violation, or None.
_Check = Callable[[Mapping[str, Any], int | None, int], str | None]


def _on_record(check: Callable[[Mapping[str, Any]], str | None]) -> _Check:
    return lambda r, b, n: check(r)


_FIELD_PLANS: dict[tuple[str, tuple[str, ...]], tuple[_Check, ...]] = {}


def fields_violation(
    name: str, rec: Mapping[str, Any], fields: tuple[str, ...], broker_ms: int | None, now_ms: int
) -> str | None:
    """:func:`violation` of ``rec`` looking only at ``fields``: the same verdict for a record whose
    other fields were checked, and passed, before (a decoder that reuses the fields it decoded and
    checked from the same bytes: the metrics split decoder's GPU identities). Only the checks
    those fields can fail run, so a sample's time and a few readings cost a fraction of the
    whole check."""
    if name != "GpuSample":
        return violation(name, rec, broker_ms, now_ms)
    plan = _FIELD_PLANS.get((name, fields))
    if plan is None:
        plan = _FIELD_PLANS[(name, fields)] = _plan(fields)
    for run in plan:
        bad = run(rec, broker_ms, now_ms)
        if bad:
            return bad
    return None


def _plan(fields: tuple[str, ...]) -> tuple[_Check, ...]:
    want = frozenset(fields)
    checks: list[_Check] = []
    if "timestamp_ms" in want:
        checks.append(_time)
    if want & _NAME_LIMITS.keys():
        checks.append(lambda r, b, n: _long_strings(r, _NAME_LIMITS, ""))
    if "allocations" in want:
        checks.append(lambda r, b, n: _allocations(r))
    checks += (_on_record(check) for trigger, check in _SAMPLE_CHECKS if want & trigger)
    return tuple(checks)


def fields_check(name: str, fields: tuple[str, ...]) -> _Check:
    """:func:`fields_violation` of ``name`` records and these ``fields`` as one function
    ``(rec, broker_ms, now_ms) -> violation or None``, for a reader that checks the same fields of
    every record (its checks chosen once, not per record)."""
    if name != "GpuSample":
        return lambda r, b, n: violation(name, r, b, n)
    plan = _plan(fields)
    if len(plan) == 2:  # the time and one more: a split decoder's usual case, unrolled
        first, second = plan

        def two(r: Mapping[str, Any], b: int | None, n: int) -> str | None:
            return first(r, b, n) or second(r, b, n)

        return two

    def check(r: Mapping[str, Any], b: int | None, n: int) -> str | None:
        for run in plan:
            bad = run(r, b, n)
            if bad:
                return bad
        return None

    return check
